"""All settings in one object. Environment variables use the `CSD_` prefix (CSD_MODEL, CSD_REDIS_URL, ...);
command-line flags override them. Bad values fail at start with a message naming the setting."""

from __future__ import annotations

import math
from pathlib import Path
from typing import Annotated, Literal

from pydantic import AliasChoices, Field, SecretStr, field_validator, model_validator
from pydantic_settings import BaseSettings, NoDecode, SettingsConfigDict

from service.decoding.drafter_registry import DrafterName, describe_drafters, drafter_entry
from service.decoding.types import Method, SpeculativeConfig
from service.executor.paths import default_cache_dir

ToolCallParserName = Literal["hermes"]


class Settings(BaseSettings):
    model_config = SettingsConfigDict(env_prefix="CSD_", extra="ignore", populate_by_name=True)

    # ---- models
    model: str = Field("embedded", description="target: 'embedded', a hub id, a folder, or a .gguf file")
    served_model_name: str | None = Field(None, description="model id shown by the API (default: the model)")
    draft_model: str | None = Field(None, description="draft model for the 'model' drafter")
    draft_head: str | None = Field(
        "embedded",
        description="weights of the 'head' drafter: 'embedded' (trained for the embedded model, used when the "
        "target is it), a folder, or empty to disable",
    )
    dtype: str = "auto"
    weights: Literal["auto", "dense", "int4"] = Field(
        "auto",
        description="linear layers' weights: 'int4' (4-bit groups of 32, CPU only), 'dense' (the dtype's), "
        "'auto' (int4 for a 4-bit GGUF file on the CPU, as the embedded model is; dense elsewhere)",
    )
    device: str = "cpu"
    cache_dir: Path = Field(default_factory=default_cache_dir)
    torch_threads: int | None = Field(
        None,
        ge=1,
        description="torch intra-op threads (default: the CPUs this process may use: its affinity mask, "
        "capped by its cgroup CPU quota and by the CPUs other processes leave idle at start-up)",
    )
    pack_cpu_weights: bool = Field(
        True, description="fp32 CPU models: pack linear weights for oneDNN (faster multi-token forwards)"
    )

    # ---- speculation defaults (a request may override them)
    method: Method = Method.CSD
    # default: 'combined' (prompt lookup, else the trained head) where a head is loaded, 'ngram' elsewhere
    drafter: DrafterName | None = Field(None, description=describe_drafters())
    num_speculative_tokens: int = Field(6, ge=0, le=64)
    tau: float = Field(0.01, gt=0, le=1)
    lambda_: float = Field(6, ge=0, validation_alias=AliasChoices("lambda", "CSD_LAMBDA"))
    lossy_threshold: float = Field(0.6, gt=0, le=1)
    guard_facts: bool = Field(
        True,
        description="csd never keeps a rescue that starts, ends or changes a number, date, negation or name, "
        "judged with the tokens before it (service/decoding/fact_guard.py)",
    )
    adaptive_speculation: bool = Field(
        True, description="verify only as much of a draft as pays for itself (measured forward costs)"
    )
    ngram_min: int = Field(1, ge=1)
    ngram_max: int = Field(4, ge=1)
    draft_pool_scope: Literal["tenant", "shared"] = Field(
        "tenant",
        description="whose earlier outputs the suffix drafter drafts from (pooled across replicas through "
        "CSD_REDIS_URL): the API key's own ('tenant': one key's outputs never shape another's drafts, which "
        "could leak through timing) or every client's ('shared')",
    )

    # ---- Online Correction Memory
    redis_url: SecretStr | None = Field(
        None,
        description="redis[s]://, redis[s]+sentinel:// or redis[s]+cluster:// URL (docs/redis.md); "
        "empty: in-process store",
    )
    ocm_path: Path | None = Field(None, description="file the in-process store persists to")
    ocm_max_patterns: int = Field(200_000, ge=100, description="cap on distinct patterns per model pair")
    ocm_flush_interval_s: float = Field(0.1, gt=0)
    ocm_refresh_interval_s: float = Field(0.5, gt=0)
    ocm_save_interval_s: float = Field(30.0, gt=0)

    # ---- HTTP service
    host: str = "127.0.0.1"
    port: int = Field(8000, ge=0, le=65535)
    # NoDecode: CSD_API_KEYS is a comma-separated list, not JSON (split by _split_keys below).
    api_keys: Annotated[list[SecretStr], NoDecode] = Field(
        default_factory=list, description="accepted Bearer keys; empty: no auth"
    )
    # The names of service.api.tools.TOOL_CALL_PARSERS (tests/api/test_tool_parsing.py checks they agree;
    # the registry itself lives with the API, which the core-only `csd generate` must not import).
    tool_call_parser: ToolCallParserName = Field(
        "hermes", description="how tool_choice 'auto' reads tool calls from the model's text"
    )
    max_tokens_cap: int = Field(2048, ge=1, description="largest max_tokens a request may ask for")
    default_max_tokens: int = Field(256, ge=1)
    default_temperature: float = Field(
        0.0, ge=0, le=2, description="for requests that send none; 0 (greedy) is the CSD paper's setting"
    )
    max_queue: int = Field(32, ge=0, description="requests waiting beyond the running batch; more get 429")
    max_batch_size: int = Field(16, ge=1, le=1024, description="generations that share each target forward")
    max_batched_tokens: int = Field(
        128, ge=1, description="tokens per engine step: a round's drafts plus a prompt chunk stay within it"
    )
    enable_prefix_caching: bool = Field(
        True,
        description="reuse the KV cache of earlier prompts' shared beginnings (system prompt, tools, earlier "
        "turns); off for models whose cache cannot be shared by blocks (sliding window)",
    )
    prefix_cache_gib: float | None = Field(
        None,
        ge=0,
        description="memory bound of the prefix cache in GiB (default: 10 % of the device's memory, at most 8)",
    )
    request_timeout_s: float = Field(300.0, gt=0)
    max_body_bytes: int = Field(1_000_000, ge=1024)
    body_timeout_s: float = Field(
        30.0, gt=0, description="a request body must arrive in full within this; else 408, connection closed"
    )
    shutdown_grace_s: float = Field(30.0, ge=0)
    responses_store_size: int = Field(
        512, ge=0, description="/v1/responses kept in memory for previous_response_id (0: none)"
    )
    # CORS (vLLM's flags): off while allowed_origins is empty. CSD_ALLOWED_ORIGINS='["https://app.example"]'
    allowed_origins: list[str] = Field(
        default_factory=list, description='origins a browser page may call from (JSON list; ["*"]: any)'
    )
    allowed_methods: list[str] = Field(default_factory=lambda: ["*"], description="CORS: allowed methods")
    allowed_headers: list[str] = Field(default_factory=lambda: ["*"], description="CORS: allowed headers")
    allow_credentials: bool = Field(False, description="CORS: allow cookies and Authorization credentials")
    ready_probe_interval_s: float = Field(
        10.0, gt=0, description="/ready trusts a target forward this recent; older: it runs a 1-token probe"
    )
    ready_probe_timeout_s: float = Field(30.0, gt=0, description="how long /ready waits for its probe")

    # ---- traffic recording (the privacy switch: off unless a folder is given; docs/traffic-learning.md)
    record_traffic: Path | None = Field(
        None,
        description="record served generations' token ids (never text) to this folder, to fine-tune the "
        "draft head on them; empty: nothing is recorded",
    )
    record_traffic_max_bytes: int = Field(
        1 << 30, ge=1024, description="compressed bytes recording may write in all; then it stops"
    )

    @field_validator("api_keys", mode="before")
    @classmethod
    def _split_keys(cls, value: object) -> object:
        if isinstance(value, str):  # CSD_API_KEYS="k1,k2"
            return [k.strip() for k in value.split(",") if k.strip()]
        return value

    @field_validator("record_traffic", mode="before")
    @classmethod
    def _empty_is_off(cls, value: object) -> object:
        # CSD_RECORD_TRAFFIC="" means off, never the current folder
        return None if isinstance(value, str) and not value.strip() else value

    @field_validator("lambda_", mode="before")
    @classmethod
    def _lambda_inf(cls, value: object) -> object:
        if isinstance(value, str) and value.strip().lower() in {"inf", "infinity", "none", "off"}:
            return math.inf
        return value

    @model_validator(mode="after")
    def _check(self) -> Settings:
        if self.ngram_min > self.ngram_max:
            raise ValueError("ngram_min must not exceed ngram_max")
        if self.drafter is None:
            self.drafter = "combined" if self.has_head else "ngram"
        needs = drafter_entry(self.drafter).needs
        if needs is not None and not getattr(self, needs):
            option = needs.replace("_", "-")
            raise ValueError(f"drafter {self.drafter!r} needs {needs} (CSD_{needs.upper()} or --{option})")
        if self.max_batched_tokens < self.max_batch_size:
            raise ValueError("max_batched_tokens must be at least max_batch_size (a token per generation)")
        if self.allow_credentials and "*" in self.allowed_origins:
            # the CORS spec forbids "*" with credentials; Starlette would silently echo every origin instead
            raise ValueError("allow_credentials needs explicit allowed_origins, not '*'")
        if self.default_max_tokens > self.max_tokens_cap:
            self.default_max_tokens = self.max_tokens_cap
        return self

    @property
    def embedded_head_applies(self) -> bool:
        """The shipped head is for the embedded model: other targets need a head of their own."""
        return self.draft_head == "embedded" and self.model == "embedded"

    @property
    def has_head(self) -> bool:
        """A 'head' drafter will be loaded: the shipped one for the embedded model, or a folder given."""
        return self.embedded_head_applies or bool(self.draft_head and self.draft_head != "embedded")

    @property
    def ocm_file(self) -> Path:
        return self.ocm_path or self.cache_dir / "ocm.sqlite"

    @property
    def ocm_spill_dir(self) -> Path:
        """Where OCM increments that could not reach Redis at shutdown wait for the next start: beside the
        OCM file, so a server with its own OCM file (a test, a second instance) has its own spill."""
        return self.ocm_file.parent / "ocm-spill"

    def speculative_config(self) -> SpeculativeConfig:
        return SpeculativeConfig(
            method=self.method,
            num_speculative_tokens=self.num_speculative_tokens,
            lambda_=self.lambda_,
            tau=self.tau,
            lossy_threshold=self.lossy_threshold,
            guard_facts=self.guard_facts,
        )
