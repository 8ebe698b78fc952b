"""The Responses API's store: the latest responses created with `store: true`, in this process's memory.

A stored response serves three requests: `GET /v1/responses/{id}` (the response object as it stands),
`previous_response_id` (its conversation, once it has finished) and, for a `background: true` one,
`POST /v1/responses/{id}/cancel`. A background response is stored when it is queued and updated as its
generation runs (queued -> in_progress -> completed, incomplete, failed or cancelled).

The store is bounded (`responses_store_size`): least recently used out first, but a background response
that has not finished is never evicted (the queue bounds how many there can be). Another replica or a
restart does not know an id: say so in the error, so a client knows to send the whole conversation.
"""

from __future__ import annotations

import asyncio
import collections
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from service.api.errors import (
    PREVIOUS_RESPONSE_NOT_COMPLETED,
    PREVIOUS_RESPONSE_NOT_FOUND,
    RESPONSE_NOT_FOUND,
    APIError,
    bad_request,
)
from service.api.schemas import ChatMessage

# the statuses a response ends in; queued and in_progress are the others (OpenAI's ResponseStatus)
FINISHED = frozenset({"completed", "incomplete", "failed", "cancelled"})


@dataclass
class StoredResponse:
    response: dict[str, Any]  # the response object, as GET returns it
    conversation: list[ChatMessage] | None = None  # input and output, once it finished with an output
    background: bool = False
    cancel: Callable[[], None] | None = None  # a running background response: stops its generation
    task: asyncio.Task | None = None  # a background response's generation (kept referenced while it runs)

    @property
    def status(self) -> str:
        return self.response["status"]

    @property
    def finished(self) -> bool:
        return self.status in FINISHED


class ResponseStore:
    """At most `max_items` responses, least recently used first out (unfinished background ones stay)."""

    def __init__(self, max_items: int) -> None:
        self.max_items = max_items
        self._items: collections.OrderedDict[str, StoredResponse] = collections.OrderedDict()

    def __len__(self) -> int:
        return len(self._items)

    @property
    def _kept(self) -> str:
        return f"the latest {self.max_items}" if self.max_items else "none (CSD_RESPONSES_STORE_SIZE=0)"

    def put(self, response_id: str, stored: StoredResponse) -> None:
        if self.max_items == 0:
            return
        self._items[response_id] = stored
        self._items.move_to_end(response_id)
        if len(self._items) > self.max_items:
            finished = [key for key, item in self._items.items() if item.finished]
            for key in finished[: len(self._items) - self.max_items]:
                del self._items[key]

    def get(self, response_id: str) -> StoredResponse:
        """The stored response, or a 404 that says what this server keeps."""
        stored = self._items.get(response_id)
        if stored is None:
            raise APIError(
                404,
                f"no stored response has the id {response_id!r}: this server keeps {self._kept} in memory, "
                "and only those created with store: true",
                param="response_id",
                code=RESPONSE_NOT_FOUND,
            )
        self._items.move_to_end(response_id)
        return stored

    def delete(self, response_id: str) -> StoredResponse:
        stored = self.get(response_id)
        del self._items[response_id]
        return stored

    def conversation(self, response_id: str) -> list[ChatMessage]:
        """For `previous_response_id`: the conversation of a response that finished with an output."""
        stored = self._items.get(response_id)
        if stored is None:
            raise bad_request(
                f"no stored response has the id {response_id!r}: this server keeps {self._kept} in memory, "
                "and only those created with store: true",
                param="previous_response_id",
                code=PREVIOUS_RESPONSE_NOT_FOUND,
            )
        if stored.conversation is None:
            raise bad_request(
                f"the response {response_id!r} is {stored.status}: only a completed or incomplete response "
                "can be continued"
                + (" (poll GET /v1/responses/{id} until it is)" if not stored.finished else ""),
                param="previous_response_id",
                code=PREVIOUS_RESPONSE_NOT_COMPLETED,
            )
        self._items.move_to_end(response_id)
        return list(stored.conversation)
