"""`csd ocm stats | top | export | import | reset`: inspect and manage the Online Correction Memory."""

from __future__ import annotations

import argparse
import contextlib
import json
import logging
import sys
from collections.abc import Iterator
from pathlib import Path

from service.cli.common import CLIError, add_model_options, quiet_libraries, settings_from_args


def add_parser(sub) -> None:
    ocm = sub.add_parser("ocm", help="inspect and manage the Online Correction Memory")
    ocm_sub = ocm.add_subparsers(dest="ocm_command", required=True)
    for name, help_text in (
        ("stats", "store health and pattern counts"),
        ("top", "most frequent divergence patterns"),
        ("export", "write patterns as JSON lines"),
        ("import", "merge patterns from JSON lines"),
        ("reset", "forget patterns"),
    ):
        p = ocm_sub.add_parser(name, help=help_text)
        add_model_options(p)
        p.add_argument("--namespace", help="only namespaces whose key contains this text")
        if name == "top":
            p.add_argument("-n", type=int, default=20)
            p.add_argument("--raw", action="store_true", help="token ids, do not decode")
        if name in ("export", "import"):
            p.add_argument("file", help="JSON lines file ('-' for standard output / input)")
        p.set_defaults(func=cmd_ocm)


def _ocm_store(args: argparse.Namespace):
    from ocm_store.factory import open_store

    settings = settings_from_args(args)
    url = settings.redis_url.get_secret_value() if settings.redis_url else None
    # An unreachable store is reported below as one line; its own warning at open would only repeat it.
    store_log = logging.getLogger("ocm_store")
    level = store_log.level
    store_log.setLevel(logging.ERROR)
    try:
        store = open_store(
            url,
            settings.ocm_file,
            max_patterns=settings.ocm_max_patterns,
            flush_interval_s=settings.ocm_flush_interval_s,
            refresh_interval_s=settings.ocm_refresh_interval_s,
        )
    finally:
        store_log.setLevel(level)
    if args.ocm_command != "stats" and not store.reachable():
        detail = store.status().detail
        store.close()
        raise CLIError(f"the OCM store is unavailable: {detail}")
    return settings, store


def _select_namespaces(store, args: argparse.Namespace) -> list:
    namespaces = store.namespaces()
    if args.namespace:
        namespaces = [ns for ns in namespaces if args.namespace in ns.key]
    return namespaces


def _decoder(args: argparse.Namespace):
    """Decodes token ids for display when the tokenizer can be had cheaply; ids otherwise."""
    if args.raw:
        return None
    try:
        settings = settings_from_args(args)
        quiet_libraries()
        from service.executor.models import load_tokenizer_for_display

        return load_tokenizer_for_display(settings.model, settings.cache_dir)
    except Exception:  # display only: fall back to ids
        return None


def cmd_ocm(args: argparse.Namespace) -> int:
    settings, store = _ocm_store(args)
    try:
        if args.ocm_command == "stats":
            # Counted from the store itself: a shared store's status only knows this process's view.
            namespaces = {ns.key: len(store.top(ns, 10**9)) for ns in store.namespaces()}
            status = store.status()
            print(json.dumps({
                "backend": status.backend, "healthy": status.healthy, "patterns": sum(namespaces.values()),
                "detail": status.detail, **status.extra, "namespaces": namespaces,
            }, indent=2))  # fmt: skip
        elif args.ocm_command == "top":
            tok = _decoder(args)
            namespaces = _select_namespaces(store, args)
            if not namespaces:
                print("no divergence patterns recorded yet (run `csd calibrate` or serve some csd requests)")
            for ns in namespaces:
                print(f"# {ns.key}")
                for p in store.top(ns, args.n):
                    if tok is not None:
                        print(
                            f"{p.count:8d}  {tok.decode([p.draft_token])!r} -> {tok.decode([p.target_token])!r}"
                        )
                    else:
                        print(f"{p.count:8d}  {p.draft_token} -> {p.target_token}")
        elif args.ocm_command == "export":
            n = 0
            with contextlib.ExitStack() as stack:
                out = (
                    sys.stdout
                    if args.file == "-"
                    else stack.enter_context(open(args.file, "w", encoding="utf-8"))
                )
                for ns in _select_namespaces(store, args):
                    for p in store.top(ns, 10**9):
                        row = {
                            "namespace": ns.key,
                            "draft_token": p.draft_token,
                            "target_token": p.target_token,
                        }
                        out.write(json.dumps({**row, "count": p.count}) + "\n")
                        n += 1
            print(f"exported {n} patterns", file=sys.stderr)
        elif args.ocm_command == "import":
            from ocm_store.base import Namespace

            grouped: dict = {}
            for item in read_prompt_file_like(args.file):
                try:
                    ns = Namespace.from_key(item["namespace"])
                    row = (int(item["draft_token"]), int(item["target_token"]), int(item["count"]))
                except (KeyError, ValueError, TypeError) as exc:
                    raise CLIError(f"{args.file}: bad pattern line {item!r} ({exc})") from None
                if row[2] < 0:
                    raise CLIError(f"{args.file}: negative count in {item!r}")
                grouped.setdefault(ns, []).append(row)
            for ns, rows in grouped.items():
                store.merge(ns, rows)
            print(f"imported {sum(len(r) for r in grouped.values())} patterns into {len(grouped)} namespaces")
        elif args.ocm_command == "reset":
            namespaces = _select_namespaces(store, args) if args.namespace else [None]
            for ns in namespaces:
                store.reset(ns)
            print("reset " + (f"{len(namespaces)} namespaces" if args.namespace else "all patterns"))
    finally:
        store.close()
    return 0


def read_prompt_file_like(path: str) -> Iterator[dict]:
    try:
        text = sys.stdin.read() if path == "-" else Path(path).read_text(encoding="utf-8")
    except OSError as exc:
        raise CLIError(f"cannot read {path!r}: {exc.strerror}") from None
    for number, line in enumerate(text.splitlines(), 1):
        if line.strip():
            try:
                yield json.loads(line)
            except json.JSONDecodeError as exc:
                raise CLIError(f"{path}:{number}: not valid JSON ({exc.msg})") from None
