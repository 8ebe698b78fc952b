"""Prefix caching seen from outside: vLLM's `vllm:prefix_cache_queries` / `vllm:prefix_cache_hits` counters
through a real server, and the same completion with and without the cache (the server default is on)."""

from __future__ import annotations

from tests.api.conftest import Server

MODEL = "SmolLM2-135M-Instruct"
SYSTEM = (
    "You are the support assistant of a bicycle shop. Be brief and friendly. Opening hours: Monday to "
    "Friday nine to six, Saturday ten to two. Repairs take two days; a flat tyre is fixed while you wait."
)


def test_shared_system_prompt_hits_and_output_is_unchanged(api_server: Server) -> None:
    def ask(http, question: str) -> dict:
        body = {
            "model": MODEL,
            "messages": [{"role": "system", "content": SYSTEM}, {"role": "user", "content": question}],
            "max_tokens": 8,
            "temperature": 0,
        }
        response = http.post("/v1/chat/completions", json=body)
        assert response.status_code == 200, response.text
        return response.json()

    before = api_server.metrics()
    with api_server.client() as http:
        first = ask(http, "When are you open on Saturday?")
        mid = api_server.metrics()
        ask(http, "How long does a repair take?")
        again = ask(http, "When are you open on Saturday?")
    after = api_server.metrics()
    assert (
        mid.value("vllm:prefix_cache_queries_total") - before.value("vllm:prefix_cache_queries_total")
        == (first["usage"]["prompt_tokens"])
    )
    # the second and third requests share the system prompt's blocks (the third its whole prompt but the end)
    hits = after.value("vllm:prefix_cache_hits_total") - mid.value("vllm:prefix_cache_hits_total")
    assert hits >= 2 * 48
    assert again["choices"][0]["message"]["content"] == first["choices"][0]["message"]["content"]
