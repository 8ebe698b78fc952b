"""An agentic workload, written for this project (issue 34) and generated from templates and a seed: no
dataset, nothing a model trained on. Three families of the traffic agents send:

- `tools`: a multi-turn tool-using loop. The system prompt declares JSON tools; each turn the agent answers
  with a JSON tool call, the harness runs the tool (a fake environment: the result is the instance's data,
  not a function of the call) and feeds the result back, until the agent is told to finish;
- `code`: a file edited across turns ("add type hints", "rename", "add a docstring"), the whole file
  re-emitted each turn;
- `extract`: structured extraction repeated over similar documents (invoices of one template, different
  values), one JSON object per document.

A conversation is a list of turns; a turn is the user message that follows the previous answer (the answer
itself is the model's, fed back by the bench). `instances(family, seed, n)` gives `n` conversations of a
family; two seeds give two different sets of the same shape (one replica's earlier traffic, another's).
"""

from __future__ import annotations

import json
import random
from dataclasses import dataclass, field

FIRST = ("Amara", "Bogdan", "Chiara", "Dmitri", "Esme", "Farid", "Greta", "Hiro", "Ines", "Jonas", "Kalani",
         "Lior", "Maren", "Nikhil", "Odette", "Pavel", "Quinn", "Rosalind", "Sefa", "Tobias")  # fmt: skip
LAST = ("Okafor", "Lindqvist", "Moreau", "Castellanos", "Varga", "Nakamura", "Haddad", "Brennan", "Sato",
        "Oyelaran", "Petrov", "Achterberg", "Ferreira", "Kowalczyk", "Delacroix", "Mbeki")  # fmt: skip
PRODUCTS = ("walnut desk organiser", "ceramic pour-over kettle", "merino running socks", "cast-iron skillet",
            "bamboo cutting board", "noise-cancelling earbuds", "linen duvet cover", "folding camp chair",
            "stainless water bottle", "LED desk lamp", "wool throw blanket", "hiking daypack")  # fmt: skip
REASONS = ("arrived damaged", "is the wrong size", "never arrived", "stopped working after a week",
           "was charged twice")  # fmt: skip
VENDORS = ("Harbourline Supplies", "Quillstone Printing", "Nordfjell Outfitters", "Cobalt Ridge Electrics",
           "Marigold Catering Co.", "Tessellate Tiles Ltd", "Brightwater Logistics", "Oakhollow Joinery")  # fmt: skip
ITEMS = ("A4 paper, 5 reams", "toner cartridge", "cable ties, pack of 100", "safety gloves", "LED panel 60x60",
         "office chair castors", "whiteboard markers", "printer maintenance", "courier delivery",
         "oak shelf bracket")  # fmt: skip

TOOLS = [
    {"name": "lookup_customer", "description": "Find a customer by id.",
     "parameters": {"customer_id": "string"}},
    {"name": "get_order", "description": "Fetch an order with its items and status.",
     "parameters": {"order_id": "string"}},
    {"name": "issue_refund", "description": "Refund an order, in full or in part.",
     "parameters": {"order_id": "string", "amount": "number", "reason": "string"}},
    {"name": "send_email", "description": "Email a customer.",
     "parameters": {"to": "string", "subject": "string", "body": "string"}},
    {"name": "finish", "description": "End the task with a short summary.",
     "parameters": {"summary": "string"}},
]  # fmt: skip

TOOLS_SYSTEM = (
    "You are a support agent that works only through tools. Tools:\n"
    + "\n".join(json.dumps(tool) for tool in TOOLS)
    + '\nAnswer every turn with exactly one tool call and nothing else, as JSON: {"tool": "<name>", '
    '"arguments": {...}}. Example of a whole task, one call per turn:\n'
    '{"tool": "lookup_customer", "arguments": {"customer_id": "C-10442"}}\n'
    '{"tool": "get_order", "arguments": {"order_id": "ORD-551023"}}\n'
    '{"tool": "issue_refund", "arguments": {"order_id": "ORD-551023", "amount": 31.5, "reason": "damaged"}}\n'
    '{"tool": "send_email", "arguments": {"to": "ana.reyes@example.net", "subject": "Your refund for order '
    'ORD-551023", "body": "Dear Ana Reyes, we have refunded 31.50 EUR for order ORD-551023. Kind regards, '
    'Support"}}\n'
    '{"tool": "finish", "arguments": {"summary": "Refunded ORD-551023 (31.50 EUR) and emailed the customer."}}'
)

EXTRACT_SYSTEM = (
    "Extract the invoice's fields and answer with JSON only, in this shape: "
    '{"vendor": string, "invoice_number": string, "date": "YYYY-MM-DD", "currency": string, '
    '"line_items": [{"description": string, "quantity": number, "unit_price": number}], "total": number}'
)


@dataclass
class Conversation:
    family: str
    system: str | None
    turns: list[str]  # user messages; the model answers each before the next is sent
    max_tokens: list[int] = field(default_factory=list)  # per turn


def _customer(rng: random.Random) -> dict:
    first, last = rng.choice(FIRST), rng.choice(LAST)
    return {
        "customer_id": f"C-{rng.randrange(10_000, 99_999)}",
        "name": f"{first} {last}",
        "email": f"{first.lower()}.{last.lower()}@example.net",
    }


def _tools(rng: random.Random) -> Conversation:
    customer = _customer(rng)
    product = rng.choice(PRODUCTS)
    order_id = f"ORD-{rng.randrange(100_000, 999_999)}"
    price = round(rng.uniform(12, 240), 2)
    reason = rng.choice(REASONS)
    task = (
        f"Customer {customer['customer_id']} wrote: 'My order {order_id} ({product}) {reason}. I would like "
        "my money back.' Look the customer up, check the order, refund it if it qualifies, email the "
        "customer, then finish."
    )
    order = {"order_id": order_id, "customer_id": customer["customer_id"], "status": "delivered",
             "items": [{"product": product, "quantity": 1, "price": price}], "total": price,
             "refundable": True}  # fmt: skip
    refund = {"refund_id": f"RF-{rng.randrange(10_000, 99_999)}", "order_id": order_id, "amount": price,
              "status": "issued"}  # fmt: skip
    results = [
        {"tool": "lookup_customer", "result": customer},
        {"tool": "get_order", "result": order},
        {"tool": "issue_refund", "result": refund},
        {"tool": "send_email", "result": {"to": customer["email"], "status": "sent"}},
    ]
    turns = [task] + [f"Tool result: {json.dumps(result)}\nNext tool call, JSON only." for result in results]
    return Conversation("tools", TOOLS_SYSTEM, turns, [96] * len(turns))


def _code(rng: random.Random) -> Conversation:
    thing = rng.choice(("invoice", "booking", "shipment", "ticket", "reading", "payment"))
    field_a, field_b = rng.sample(("amount", "weight", "duration", "count", "price", "distance", "score"), 2)
    limit = rng.randrange(10, 500)
    source = f'''import json
from dataclasses import dataclass


@dataclass
class {thing.title()}:
    id: str
    {field_a}: float
    {field_b}: float
    tags: list


def load_{thing}s(path):
    with open(path) as f:
        rows = json.load(f)
    return [{thing.title()}(r["id"], r["{field_a}"], r["{field_b}"], r.get("tags", [])) for r in rows]


def total_{field_a}(items):
    return sum(item.{field_a} for item in items)


def over_limit(items, limit={limit}):
    return [item for item in items if item.{field_a} > limit]


def by_tag(items, tag):
    return [item for item in items if tag in item.tags]
'''
    new_name = rng.choice(("records", "entries", "batch"))
    turns = [
        f"Here is a Python module:\n```python\n{source}```\nAdd type hints to every function. Reply with the "
        "complete file in one ```python block.",
        f"Now rename the parameter `items` to `{new_name}` everywhere. Reply with the complete file.",
        "Add a one-line docstring to `over_limit`. Reply with the complete file.",
    ]
    return Conversation("code", None, turns, [256] * len(turns))


def _invoice(rng: random.Random) -> str:
    vendor = rng.choice(VENDORS)
    lines = rng.sample(ITEMS, rng.randrange(2, 4))
    rows, total = [], 0.0
    for item in lines:
        quantity = rng.randrange(1, 12)
        unit = round(rng.uniform(2, 180), 2)
        total += quantity * unit
        rows.append(f"  {item:<28} {quantity:>3} x {unit:>8.2f}")
    customer = _customer(rng)
    return (
        f"INVOICE\n{vendor}\nInvoice no. INV-{rng.randrange(1000, 9999)}-{rng.choice('ABCDEFGH')}\n"
        f"Date: {rng.randrange(1, 28):02d}/{rng.randrange(1, 13):02d}/2026\n"
        f"Bill to: {customer['name']}, {customer['email']}\n"
        "Items:\n" + "\n".join(rows) + f"\nTotal due: EUR {total:.2f}\nPayment within 30 days."
    )


def _extract(rng: random.Random) -> Conversation:
    return Conversation("extract", EXTRACT_SYSTEM, [_invoice(rng)], [128])


FAMILIES = {"tools": _tools, "code": _code, "extract": _extract}


def instances(family: str, seed: int, n: int) -> list[Conversation]:
    rng = random.Random(f"{family}-{seed}")
    return [FAMILIES[family](rng) for _ in range(n)]


def workload(seed: int, sizes: dict[str, int]) -> list[Conversation]:
    """The families interleaved (as a fleet sees them): tools, code, extract, tools, ..."""
    lists = [instances(family, seed, sizes[family]) for family in FAMILIES if sizes.get(family)]
    out: list[Conversation] = []
    for i in range(max(map(len, lists), default=0)):
        out.extend(items[i] for items in lists if i < len(items))
    return out
