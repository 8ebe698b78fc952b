"""`csd`: the command-line tool (generate, calibrate, ocm, serve).

Every failure a user can cause (a bad flag value, a missing model, a wrong file) ends in one line
`csd: error: ...` and exit status 2, never a traceback.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import logging
import math
import os
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import get_args

from pydantic import ValidationError
from pydantic_settings import SettingsError

from ocm_store.base import OCMStoreError
from service.decoding.drafter_registry import DRAFTER_NAMES, describe_drafters
from service.decoding.threads import prepare_wait_policy
from service.decoding.types import DecodingError, Method, SamplingParams
from service.log_format import configure_root

EXIT_USAGE = 2


class CLIError(Exception):
    """A user-facing failure: printed as one line."""


# ---------------------------------------------------------------- shared options


def _add_model_options(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("models (default from CSD_* environment variables)")
    g.add_argument("--model", help="target: 'embedded' (default), hub id, folder or .gguf file")
    g.add_argument("--draft-model", help="draft model for --drafter model")
    g.add_argument(
        "--draft-head", help="weights of the 'head' drafter: 'embedded' (default), a folder, or '' to disable"
    )
    g.add_argument("--dtype", help="auto | float32 | bfloat16 | float16")
    g.add_argument(
        "--weights",
        choices=("auto", "dense", "int4"),
        help="int4: 4-bit weights (CPU); auto (default): int4 for a 4-bit GGUF on the CPU, else dense",
    )
    g.add_argument("--device", help="cpu | cuda | cuda:N | auto")
    g.add_argument("--cache-dir", type=Path, help="where converted GGUF weights and the OCM file live")
    g.add_argument(
        "--redis-url", help="shared OCM in Redis: redis[s]://, redis[s]+sentinel://, redis[s]+cluster://"
    )
    g.add_argument("--ocm-path", type=Path, help="file the in-process OCM persists to")
    g.add_argument(
        "--torch-threads",
        type=int,
        help="torch intra-op threads (default: the CPUs this process may use by affinity mask and cgroup "
        "quota, less those other processes keep busy)",
    )


def _add_speculation_options(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("speculation")
    g.add_argument("--method", choices=[m.value for m in Method])
    g.add_argument(
        "--drafter",
        choices=DRAFTER_NAMES,
        help=f"{describe_drafters()}; default: combined on the embedded model, else ngram",
    )
    g.add_argument("--num-speculative-tokens", type=int)
    g.add_argument("--tau", type=float, help="semantic gate: p(draft)/p(target top) >= tau, in (0, 1]")
    g.add_argument("--lambda", dest="lambda_", type=float, help="frequency gate: rescue when count > lambda")
    g.add_argument("--ngram-min", type=int)
    g.add_argument("--ngram-max", type=int)


_SETTING_FLAGS = (
    "model", "draft_model", "draft_head", "dtype", "weights", "device", "cache_dir", "redis_url", "ocm_path", "method", "drafter",
    "num_speculative_tokens", "tau", "lambda_", "ngram_min", "ngram_max", "host", "port", "api_keys",
    "served_model_name", "torch_threads", "max_queue", "max_batch_size", "max_batched_tokens", "max_tokens_cap", "default_max_tokens",
    "default_temperature", "request_timeout_s", "max_body_bytes", "body_timeout_s", "shutdown_grace_s",
    "tool_call_parser", "record_traffic", "record_traffic_max_bytes",
    "responses_store_size", "allowed_origins", "allowed_methods", "allowed_headers", "allow_credentials",
    "enable_prefix_caching", "prefix_cache_gib",
)  # fmt: skip


def _json_list(text: str) -> list[str]:
    """A flag's JSON list of strings, as vLLM takes them: '["https://app.example"]'."""
    try:
        value = json.loads(text)
    except json.JSONDecodeError:
        raise argparse.ArgumentTypeError(
            f"not a JSON list: {text!r} (e.g. '[\"https://app.example\"]')"
        ) from None
    if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
        raise argparse.ArgumentTypeError(f"not a JSON list of strings: {text!r}")
    return value


def settings_from_args(args: argparse.Namespace):  # -> Settings
    from service.config import Settings

    overrides = {k: getattr(args, k) for k in _SETTING_FLAGS if getattr(args, k, None) is not None}
    if "lambda_" in overrides:
        overrides["lambda"] = overrides.pop("lambda_")
    try:
        return Settings(**overrides)
    except ValidationError as exc:
        first = exc.errors()[0]
        where = ".".join(str(x) for x in first.get("loc", ())) or "settings"
        raise CLIError(f"invalid {where}: {first['msg']}") from None
    except SettingsError as exc:  # a CSD_* environment variable that cannot be parsed
        raise CLIError(str(exc)) from None


def _build_runtime(args: argparse.Namespace, **overrides):
    from service.decoding.paths import check_model_spec

    settings = settings_from_args(args).model_copy(update=overrides)
    for spec in (settings.model, settings.draft_model):
        if spec:
            check_model_spec(spec)  # a missing or broken file is reported before the slow imports
    _quiet_libraries()
    from service.runtime import Runtime

    if args.command != "serve":
        print(f"csd: loading {settings.model} ...", file=sys.stderr, flush=True)
    return Runtime.build(settings)


def _quiet_libraries() -> None:
    """Called just before the heavy imports: validating arguments never pays for transformers."""
    import transformers

    transformers.utils.logging.set_verbosity_error()
    transformers.utils.logging.disable_progress_bar()


# ---------------------------------------------------------------- generate


def _read_prompt(args: argparse.Namespace) -> str:
    prompt = args.prompt
    if prompt == "-":
        prompt = sys.stdin.read()
    if not prompt or not prompt.strip():
        raise CLIError("prompt must not be empty")
    return prompt


def _sampling_from_args(args: argparse.Namespace, settings) -> SamplingParams:
    max_tokens = args.max_tokens if args.max_tokens is not None else settings.default_max_tokens
    if max_tokens > settings.max_tokens_cap:
        raise CLIError(
            f"max tokens {max_tokens} exceeds the cap of {settings.max_tokens_cap} (CSD_MAX_TOKENS_CAP)"
        )
    return SamplingParams(
        max_tokens=max_tokens,
        temperature=args.temperature,
        top_p=args.top_p,
        seed=args.seed,
        stop=tuple(args.stop or ()),
    )


def cmd_generate(args: argparse.Namespace) -> int:
    prompt = _read_prompt(args)
    settings = settings_from_args(args)
    sampling = _sampling_from_args(args, settings)  # validate before the slow model load
    spec = settings.speculative_config()
    # One generation: only the single-row costs matter, and none when the method does not speculate.
    runtime = _build_runtime(
        args, max_batch_size=1, adaptive_speculation=settings.adaptive_speculation and spec.speculates
    )
    from service.decoding import run_alone
    from service.decoding.text import encode_chat, encode_prompt

    try:
        tok = runtime.target.tokenizer
        if args.chat:
            messages = ([{"role": "system", "content": args.system}] if args.system else []) + [
                {"role": "user", "content": prompt}
            ]
            ids = encode_chat(tok, messages)
        else:
            ids = encode_prompt(tok, prompt)
        generation = runtime.engine.generate(ids, sampling, spec, drafter=settings.drafter)
        for step in run_alone(generation):
            if not args.json and step.text:
                sys.stdout.write(step.text)
                sys.stdout.flush()
        stats = generation.stats.as_dict()
        if args.json:
            out = {
                "model": runtime.model_id,
                "method": spec.method.value,
                "drafter": settings.drafter if spec.speculates else None,
                "text": generation.text,
                "finish_reason": generation.finish_reason,
                "tokens": [
                    {
                        "id": t.token_id,
                        "text": tok.decode([t.token_id]),
                        "provenance": t.provenance.value,
                        **(
                            {
                                "replaced": t.replaced_token_id,
                                "replaced_text": tok.decode([t.replaced_token_id]),
                            }
                            if t.replaced_token_id is not None
                            else {}
                        ),
                    }
                    for t in generation.tokens
                ],
                "stats": stats,
            }
            print(json.dumps(out, ensure_ascii=False))
        else:
            print()
            print(
                f"[{spec.method.value}] {stats['completion_tokens']} tokens, {stats['tokens_per_second']} tokens/s, "
                f"{stats['tokens_per_forward']} tokens per target forward, "
                f"acceptance {stats['acceptance_rate']:.1%}, rescue {stats['rescue_rate']:.1%} "
                f"(accepted {stats['accepted_tokens']}, rescued {stats['rescued_tokens']}, "
                f"drafted {stats['draft_tokens']}), finish: {generation.finish_reason}",
                file=sys.stderr,
            )
        # The answer is out; a cost measurement that ran out of its start budget finishes now, so the next
        # run finds it in the cache.
        while runtime.refine_costs is not None and runtime.refine_costs():
            pass
    finally:
        runtime.close()
    return 0


# ---------------------------------------------------------------- calibrate


def read_prompt_file(path: Path) -> Iterator[dict]:
    """JSON lines with "prompt" (chat user message), "messages" or "text" (raw completion); or plain text
    with one prompt per line."""
    try:
        lines = path.read_text(encoding="utf-8").splitlines()
    except OSError as exc:
        raise CLIError(f"cannot read prompts file {str(path)!r}: {exc.strerror}") from None
    for number, line in enumerate(lines, 1):
        if not line.strip():
            continue
        if line.lstrip().startswith("{"):
            try:
                item = json.loads(line)
            except json.JSONDecodeError as exc:
                raise CLIError(f"{path}:{number}: not valid JSON ({exc.msg})") from None
            if not any(k in item for k in ("prompt", "messages", "text")):
                raise CLIError(f"{path}:{number}: needs a 'prompt', 'messages' or 'text' field")
            yield item
        else:
            yield {"prompt": line}


def cmd_calibrate(args: argparse.Namespace) -> int:
    items = list(read_prompt_file(args.prompts))
    if not items:
        raise CLIError(f"prompts file {str(args.prompts)!r} holds no prompts")
    settings = settings_from_args(args)
    SamplingParams(max_tokens=args.max_tokens)  # validates the budget before the slow model load
    # Verify every draft in full: calibration is there to record divergences, and the adaptive policy
    # would skip the drafts it expects to lose, which are exactly the ones that teach the memory.
    runtime = _build_runtime(args, adaptive_speculation=False)
    from service.calibration import calibrate  # imports torch: only once the arguments are known good

    try:
        namespace = runtime.namespaces[settings.drafter]
        before = runtime.store.status().patterns
        started = time.perf_counter()

        def progress(done) -> None:
            print(
                f"\rcalibrating {done.prompts}/{len(items)}: {done.divergences} divergences recorded",
                end="",
                file=sys.stderr,
                flush=True,
            )

        result = calibrate(
            runtime.engine,
            items,
            drafter=settings.drafter,
            num_speculative_tokens=settings.num_speculative_tokens,
            max_tokens=args.max_tokens,
            on_prompt=progress,
        )
        print(file=sys.stderr)
        runtime.store.close()
        after = runtime.store.status().patterns
        print(
            f"calibrated {result.prompts} prompts in {time.perf_counter() - started:.1f}s: "
            f"{result.divergences} divergences, {after - before} new patterns ({after} in the store) "
            f"for {namespace.key}"
        )
    finally:
        runtime.close()
    return 0


# ---------------------------------------------------------------- ocm


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
        _quiet_libraries()
        from service.decoding.models import load_tokenizer_for_display

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


# ---------------------------------------------------------------- serve

LOG_LEVELS = ["critical", "error", "warning", "info", "debug"]


def cmd_serve(args: argparse.Namespace) -> int:
    settings = settings_from_args(args)
    _quiet_libraries()
    from service.api.server import bind_socket, serve

    log_level = args.log_level or os.environ.get("CSD_LOG_LEVEL", "info").lower()
    # Our own loggers follow --log-level too (the root logger stays at CSD_LOG_LEVEL for libraries).
    for name in ("service", "ocm_store"):
        logging.getLogger(name).setLevel(log_level.upper())
    try:
        sock = bind_socket(settings.host, settings.port)
    except OSError as exc:
        raise CLIError(f"cannot listen on {settings.host}:{settings.port}: {exc.strerror or exc}") from None
    host, port = sock.getsockname()[:2]
    shown = f"[{host}]" if ":" in host else host
    auth = f"{len(settings.api_keys)} API key(s)" if settings.api_keys else "no API keys"
    print(
        f"csd: serving {settings.model} on http://{shown}:{port} ({auth}); loading the model, "
        "GET /ready answers 200 once it generates",
        file=sys.stderr,
        flush=True,
    )
    error = serve(settings, log_level=log_level, sock=sock)
    if error is not None:
        raise CLIError(f"cannot start: {error}")
    return 0


# ---------------------------------------------------------------- parser


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="csd", description="Calibrated Speculative Decoding")
    sub = parser.add_subparsers(dest="command", required=True)

    gen = sub.add_parser("generate", help="generate text from a prompt and show acceptance statistics")
    gen.add_argument("prompt", help="the prompt ('-' reads standard input)")
    gen.add_argument("--chat", action="store_true", help="wrap the prompt in the model's chat template")
    gen.add_argument("--system", help="system message for --chat")
    gen.add_argument("--max-tokens", type=int)
    gen.add_argument("--temperature", type=float, default=0.0)
    gen.add_argument("--top-p", type=float, default=1.0)
    gen.add_argument("--seed", type=int)
    gen.add_argument("--stop", action="append", help="stop string (repeatable)")
    gen.add_argument("--json", action="store_true", help="print one JSON object with tokens and statistics")
    _add_model_options(gen)
    _add_speculation_options(gen)
    gen.set_defaults(func=cmd_generate)

    cal = sub.add_parser(
        "calibrate", help="warm the OCM by strict speculative decoding over in-domain prompts"
    )
    cal.add_argument("--prompts", type=Path, required=True, help="JSON lines or one prompt per line")
    cal.add_argument("--max-tokens", type=int, default=128)
    _add_model_options(cal)
    _add_speculation_options(cal)
    cal.set_defaults(func=cmd_calibrate)

    srv = sub.add_parser("serve", help="run the OpenAI-compatible HTTP service")
    g = srv.add_argument_group("HTTP service (default from CSD_* environment variables)")
    g.add_argument("--host", help="address to listen on (default 127.0.0.1)")
    g.add_argument("--port", type=int, help="port to listen on (default 8000; 0: any free port)")
    g.add_argument(
        "--api-key",
        dest="api_keys",
        action="append",
        metavar="KEY",
        help="accepted Bearer key (repeatable; prefer CSD_API_KEYS=k1,k2: flags show up in ps)",
    )
    g.add_argument("--served-model-name", help="model id shown by the API (default: the model's name)")
    g.add_argument("--max-queue", type=int, help="requests waiting beyond the running batch; more get 429")
    g.add_argument("--max-batch-size", type=int, help="generations sharing each target forward")
    g.add_argument(
        "--max-batched-tokens", type=int, help="tokens in one target forward (also the prefill chunk)"
    )
    g.add_argument("--max-tokens-cap", type=int, help="largest max_tokens a request may ask for")
    g.add_argument("--default-max-tokens", type=int, help="max_tokens of requests that send none")
    g.add_argument("--default-temperature", type=float, help="temperature of requests that send none (0)")
    g.add_argument("--request-timeout", dest="request_timeout_s", type=float, metavar="SECONDS")
    g.add_argument("--max-body-bytes", type=int, help="largest request body; larger gets 413")
    g.add_argument(
        "--body-timeout", dest="body_timeout_s", type=float, metavar="SECONDS", help="slower bodies get 408"
    )
    g.add_argument(
        "--shutdown-grace", dest="shutdown_grace_s", type=float, metavar="SECONDS", help="to drain on SIGTERM"
    )
    g.add_argument(
        "--responses-store-size",
        type=int,
        help="responses kept for previous_response_id (default 512; 0: none)",
    )
    g.add_argument(
        "--enable-prefix-caching",
        action=argparse.BooleanOptionalAction,
        help="reuse the KV cache of prompts' shared beginnings (default: on where the model allows it)",
    )
    g.add_argument(
        "--prefix-cache-gib", type=float, metavar="GIB", help="prefix cache bound (default: 10%% of memory)"
    )
    g.add_argument(
        "--record-traffic",
        type=Path,
        metavar="DIR",
        help="record served token ids (never text) to DIR for `python -m training --from-traffic DIR` "
        "(default: off; CSD_RECORD_TRAFFIC)",
    )
    g.add_argument(
        "--record-traffic-max-bytes", type=int, metavar="BYTES", help="recording stops at this size (1 GiB)"
    )
    g.add_argument("--log-level", choices=LOG_LEVELS, help="default: CSD_LOG_LEVEL, or info")
    from service.config import ToolCallParserName

    g.add_argument(
        "--tool-call-parser",
        choices=list(get_args(ToolCallParserName)),
        help="how tool_choice 'auto' reads tool calls from the model's text (default: hermes)",
    )
    cors = srv.add_argument_group("CORS: browser pages on other origins (off unless --allowed-origins)")
    cors.add_argument(
        "--allowed-origins",
        type=_json_list,
        metavar="JSON",
        help='e.g. \'["https://app.example"]\'; ["*"]: any',
    )
    cors.add_argument("--allowed-methods", type=_json_list, metavar="JSON", help='default ["*"]')
    cors.add_argument("--allowed-headers", type=_json_list, metavar="JSON", help='default ["*"]')
    cors.add_argument(
        "--allow-credentials", action="store_true", default=None, help="allow cookies and credentials"
    )
    _add_model_options(srv)
    _add_speculation_options(srv)
    srv.set_defaults(func=cmd_serve)

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
        _add_model_options(p)
        p.add_argument("--namespace", help="only namespaces whose key contains this text")
        if name == "top":
            p.add_argument("-n", type=int, default=20)
            p.add_argument("--raw", action="store_true", help="token ids, do not decode")
        if name in ("export", "import"):
            p.add_argument("file", help="JSON lines file ('-' for standard output / input)")
        p.set_defaults(func=cmd_ocm)
    return parser


def _requested_threads(args: argparse.Namespace) -> int | None:
    """--torch-threads, else CSD_TORCH_THREADS where it is a number (Settings validates it later)."""
    if args.torch_threads is not None:
        return args.torch_threads
    try:
        return int(os.environ["CSD_TORCH_THREADS"])
    except (KeyError, ValueError):
        return None


def main(argv: list[str] | None = None) -> int:
    log_level = os.environ.get("CSD_LOG_LEVEL", "WARNING")
    if log_level.lower() not in LOG_LEVELS:
        print(f"csd: error: CSD_LOG_LEVEL must be one of {', '.join(LOG_LEVELS)}", file=sys.stderr)
        return EXIT_USAGE
    configure_root(log_level)
    args = build_parser().parse_args(argv)
    if hasattr(args, "torch_threads"):  # a command that runs a model (the others never load torch)
        # before anything loads torch's OpenMP, which reads its wait policy once (service/decoding/threads.py)
        prepare_wait_policy(_requested_threads(args))
    if getattr(args, "lambda_", None) is not None and math.isnan(args.lambda_):
        print("csd: error: lambda must be a number >= 0", file=sys.stderr)
        return EXIT_USAGE
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    try:
        return args.func(args)
    except (CLIError, DecodingError, OCMStoreError) as exc:
        # one line, whatever a library put in the message
        print(f"csd: error: {' '.join(str(exc).split())}", file=sys.stderr)
        return EXIT_USAGE
    except KeyboardInterrupt:
        print(file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
