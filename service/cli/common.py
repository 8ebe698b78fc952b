"""What the commands share: the one-line user error, the model and speculation flags, the flags as the one
Settings object, and building the runtime (the heavy imports come only then)."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from pydantic import ValidationError
from pydantic_settings import SettingsError

from service.decoding.drafter_registry import DRAFTER_NAMES, describe_drafters
from service.decoding.types import Method

EXIT_USAGE = 2


class CLIError(Exception):
    """A user-facing failure: printed as one line."""


def add_model_options(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("models (default from CSD_* environment variables)")
    g.add_argument("--model", help="target: 'embedded' (default), hub id, folder or .gguf file")
    g.add_argument(
        "--draft-model",
        help="draft model for --drafter model: a model spec, or embedded-exit (the embedded target's first 15 "
        "layers behind a trained exit, shipped)",
    )
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
    g.add_argument(
        "--draft-pool-scope",
        choices=("tenant", "shared"),
        help="whose earlier outputs the suffix drafter drafts from: the API key's own (default) or every "
        "client's (CSD_DRAFT_POOL_SCOPE)",
    )


def add_engine_options(p: argparse.ArgumentParser) -> None:
    """The flags of a command that runs the engine (generate, calibrate, serve): models, then speculation."""
    add_model_options(p)
    _add_speculation_options(p)


_SETTING_FLAGS = (
    "model", "draft_model", "draft_head", "dtype", "weights", "device", "cache_dir", "redis_url", "ocm_path", "method", "drafter",
    "num_speculative_tokens", "tau", "lambda_", "ngram_min", "ngram_max", "draft_pool_scope", "host", "port", "api_keys",
    "served_model_name", "torch_threads", "max_queue", "max_batch_size", "max_batched_tokens", "max_tokens_cap", "default_max_tokens",
    "default_temperature", "request_timeout_s", "max_body_bytes", "body_timeout_s", "shutdown_grace_s",
    "tool_call_parser", "record_traffic", "record_traffic_max_bytes",
    "responses_store_size", "allowed_origins", "allowed_methods", "allowed_headers", "allow_credentials",
    "enable_prefix_caching", "prefix_cache_gib",
)  # fmt: skip


def json_list(text: str) -> list[str]:
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


def build_runtime(args: argparse.Namespace, **overrides):
    from service.executor.paths import check_model_spec

    settings = settings_from_args(args).model_copy(update=overrides)
    for spec in (settings.model, settings.draft_model):
        if spec:
            check_model_spec(spec)  # a missing or broken file is reported before the slow imports
    quiet_libraries()
    from service.runtime import Runtime

    if args.command != "serve":
        print(f"csd: loading {settings.model} ...", file=sys.stderr, flush=True)
    return Runtime.build(settings)


def quiet_libraries() -> None:
    """Called just before the heavy imports: validating arguments never pays for transformers."""
    import transformers

    transformers.utils.logging.set_verbosity_error()
    transformers.utils.logging.disable_progress_bar()


LOG_LEVELS = ["critical", "error", "warning", "info", "debug"]
