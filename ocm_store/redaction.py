"""Keep credentials out of logs, exceptions and status: a Redis URL is only ever shown masked."""

from __future__ import annotations

from urllib.parse import parse_qsl, unquote, urlencode, urlsplit, urlunsplit

MASK = "***"


def url_secrets(url: str) -> list[str]:
    """The secret parts of a URL: the password (raw and percent-decoded) and any `password=` or
    `sentinel_password=` query value."""
    found: list[str] = []
    try:
        parts = urlsplit(url)
        if parts.password:
            found += [parts.password, unquote(parts.password)]
        found += [
            v for k, v in parse_qsl(parts.query, keep_blank_values=True) if k.endswith("password") and v
        ]
    except ValueError:
        pass
    return sorted({s for s in found if s}, key=len, reverse=True)


def mask_url(url: str) -> str:
    """redis://user:secret@host:6379/0 -> redis://user:***@host:6379/0 (the user name stays: not a secret)."""
    try:
        parts = urlsplit(url)
        netloc = parts.netloc
        if parts.password is not None:
            userinfo, _, hostport = netloc.rpartition("@")
            user = userinfo.split(":", 1)[0]
            netloc = f"{user}:{MASK}@{hostport}"
        query = urlencode(
            [
                (k, MASK if k.endswith("password") else v)
                for k, v in parse_qsl(parts.query, keep_blank_values=True)
            ],
            safe="*/",
        )
        return urlunsplit((parts.scheme, netloc, parts.path, query, ""))
    except ValueError:
        return f"<unparseable Redis URL, {MASK}>"


class Scrubber:
    """Replaces the secrets of one URL in any text (an exception message from a library, for instance)."""

    def __init__(self, url: str) -> None:
        self._secrets = url_secrets(url)

    def __call__(self, text: str) -> str:
        for secret in self._secrets:
            text = text.replace(secret, MASK)
        return text
