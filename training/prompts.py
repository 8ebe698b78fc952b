"""The prompt corpus the drafter is distilled on: assembled offline from templates and topic lists.

Source and licence: every template and topic below was written for this project (Apache-2.0, like the rest
of the repository); no third-party data set is used. The answers the drafter learns from are the target's
own (see `training.distill`), which is what self-distillation wants: the drafter learns what the target
says, not what some corpus says.

Two kinds of prompt, in the proportions of the service's traffic that speculation serves:
- open prompts (explain, how-to, compare, lists, writing, opinions, small arithmetic, small code tasks);
- grounded prompts (summarise / rewrite / answer from a passage), whose passages are the target's own
  answers to open prompts of the first stage (`grounded_prompts`), so no outside text is needed.

Disjoint from every evaluation set of `bench/`: `assemble()` drops any prompt that shares an 8-word
sequence with a bench prompt (calibration included), and tests/training checks the shipped corpus.
"""

from __future__ import annotations

import random
import re
from collections.abc import Iterable

TOPICS = [
    "photosynthesis",
    "the water cycle",
    "plate tectonics",
    "black holes",
    "the immune system",
    "compound interest",
    "inflation",
    "supply and demand",
    "the stock market",
    "vaccines",
    "machine learning",
    "the internet",
    "encryption",
    "electric cars",
    "solar panels",
    "wind turbines",
    "recycling",
    "composting",
    "the French Revolution",
    "the Roman Empire",
    "the printing press",
    "the Industrial Revolution",
    "democracy",
    "the United Nations",
    "volcanoes",
    "earthquakes",
    "the human heart",
    "sleep",
    "meditation",
    "nutrition labels",
    "protein",
    "vitamins",
    "caffeine",
    "the moon's phases",
    "tides",
    "rainbows",
    "lightning",
    "snowflakes",
    "glaciers",
    "deserts",
    "rainforests",
    "coral",
    "honeybees",
    "migration of birds",
    "dinosaurs",
    "fossils",
    "evolution",
    "DNA",
    "genetics",
    "antibiotics",
    "the scientific method",
    "gravity",
    "magnetism",
    "electricity",
    "batteries",
    "computers",
    "operating systems",
    "databases",
    "cloud computing",
    "spreadsheets",
    "budgeting",
    "credit scores",
    "mortgages",
    "insurance",
    "taxes",
    "renewable energy",
    "nuclear power",
    "the Olympic Games",
    "chess",
    "jazz",
    "the piano",
    "photography",
    "painting with watercolours",
    "baking bread",
    "fermentation",
    "coffee brewing",
    "tea",
    "gardening",
    "houseplants",
    "beekeeping",
    "public transport",
    "city planning",
    "libraries",
    "museums",
    "the postal service",
    "maps",
    "GPS",
    "satellites",
    "the International Space Station",
    "Mars",
    "Jupiter",
    "the Sun",
    "comets",
    "time zones",
    "calendars",
    "leap years",
    "languages",
    "grammar",
    "poetry",
    "novels",
    "theatre",
    "film editing",
    "video games",
    "social media",
    "online privacy",
    "passwords",
    "email etiquette",
    "remote work",
    "teamwork",
    "leadership",
    "negotiation",
    "public speaking",
    "job interviews",
    "writing a CV",
    "first aid",
    "hand washing",
    "running",
    "swimming",
    "yoga",
    "cycling",
    "hiking",
    "camping",
    "fishing",
    "sailing",
    "bridges",
    "skyscrapers",
    "tunnels",
    "trains",
    "aeroplanes",
    "ships",
    "rockets",
    "robots",
    "3D printing",
    "smartphones",
    "headphones",
    "television",
    "radio",
]

TASKS = [
    "learn to cook simple meals",
    "save money on groceries",
    "start running regularly",
    "keep a houseplant alive",
    "prepare for an exam",
    "write a good cover letter",
    "organise my desk",
    "make friends in a new city",
    "reduce screen time",
    "fall asleep faster",
    "learn to play the guitar",
    "plan a birthday party",
    "train a puppy",
    "clean a kitchen quickly",
    "start a vegetable garden",
    "improve my handwriting",
    "learn a new programming language",
    "back up my computer",
    "choose a laptop",
    "pack for a long trip",
    "speak more confidently in meetings",
    "stop procrastinating",
    "read more books",
    "drink more water",
    "start journaling",
    "fix a flat bicycle tyre",
    "paint a room",
    "write a short speech",
    "learn to draw",
    "keep a budget",
    "choose a good password",
    "reduce food waste",
    "start meditating",
    "study with a friend",
    "prepare a presentation",
    "learn to swim as an adult",
    "make a good cup of tea",
    "remember names better",
    "get up earlier",
    "plan a weekly menu",
]

PAIRS = [
    ("a virus", "a bacterium"),
    ("weather", "climate"),
    ("a lake", "a sea"),
    ("a tortoise", "a turtle"),
    ("RAM", "storage"),
    ("a loan", "a grant"),
    ("speed", "velocity"),
    ("mass", "weight"),
    ("an alligator", "a crocodile"),
    ("a simile", "a metaphor"),
    ("a hurricane", "a tornado"),
    ("a democracy", "a monarchy"),
    ("a novel", "a short story"),
    ("baking", "roasting"),
    ("a town", "a city"),
    ("saving", "investing"),
    ("a planet", "a star"),
    ("a fruit", "a vegetable"),
    ("Python", "JavaScript"),
    ("a laptop", "a desktop computer"),
    ("trains", "buses"),
    ("cats", "dogs as pets"),
    ("tea", "coffee"),
    ("reading", "listening to audiobooks"),
    ("renting", "buying a home"),
    ("a debit card", "a credit card"),
    ("an atom", "a molecule"),
    ("a cold", "the flu"),
    ("summer", "winter holidays"),
    ("a poem", "a song"),
]

THINGS = [
    "healthy breakfast ideas",
    "indoor hobbies",
    "ways to save energy at home",
    "classic board games",
    "reasons to learn history",
    "tips for a long car journey",
    "qualities of a good teacher",
    "uses for an old jar",
    "ways to be kind to a neighbour",
    "common mistakes new drivers make",
    "easy exercises to do at a desk",
    "things to bring to a picnic",
    "questions to ask at a museum",
    "ways to celebrate a small success",
    "simple science experiments for children",
    "habits of organised people",
    "ways to learn new words",
    "reasons to visit a library",
    "snacks for a study session",
    "ideas for a school project about the ocean",
]

GENRES = [
    "poem",
    "short story",
    "letter",
    "email",
    "speech",
    "diary entry",
    "product description",
    "news report",
    "dialogue",
    "limerick",
    "thank-you note",
    "advertisement",
    "fairy tale",
    "haiku",
]

SUBJECTS = [
    "a lost umbrella",
    "the first day of spring",
    "a robot learning to paint",
    "a rainy afternoon",
    "a friendly dragon",
    "an old bicycle",
    "a city at night",
    "a cat who wants to fly",
    "a new neighbour",
    "a surprise party",
    "the last train home",
    "a snowy mountain",
    "a talking tree",
    "a forgotten library book",
    "a lighthouse in a storm",
    "a busy market",
    "a paper boat",
    "a student's first exam",
    "a garden in autumn",
    "a clock that runs backwards",
    "a quiet village",
    "a journey by sea",
    "the smell of fresh bread",
    "a lost key",
    "a school science fair",
]

OPINIONS = [
    "working four days a week",
    "homework for young children",
    "school uniforms",
    "living abroad",
    "learning a musical instrument",
    "online shopping",
    "reading on paper instead of screens",
    "owning a car in a city",
    "studying at night",
    "keeping a pet",
    "eating less meat",
    "taking a gap year",
    "using public transport",
    "working from a café",
    "group projects",
]

CODE_TASKS = [
    "reverses a string",
    "checks whether a number is prime",
    "counts the vowels in a sentence",
    "returns the largest number in a list",
    "removes duplicates from a list while keeping the order",
    "computes the factorial of n",
    "returns the n-th Fibonacci number",
    "checks whether a word is a palindrome",
    "converts Celsius to Fahrenheit",
    "sums the digits of an integer",
    "sorts a list of words by length",
    "merges two sorted lists",
    "counts how often each word appears in a text",
    "flattens a nested list",
    "returns the average of a list of numbers",
    "finds the second smallest number in a list",
    "capitalises the first letter of every word",
    "checks whether two strings are anagrams",
    "returns the greatest common divisor of two numbers",
    "splits a list into chunks of size n",
]

ITEMS = ["apples", "pencils", "notebooks", "tickets", "cupcakes", "stamps", "bottles of juice", "books"]

OPEN_TEMPLATES: list[tuple[str, str]] = [
    ("explain", "Explain {topic} in simple terms."),
    ("explain", "What is {topic}?"),
    ("explain", "How does {topic} work?"),
    ("explain", "Give me a short overview of {topic}."),
    ("explain", "Why is {topic} important?"),
    ("explain", "Describe {topic} to someone who has never heard of it."),
    ("explain", "Tell me three interesting facts about {topic}."),
    ("explain", "What should a beginner know about {topic}?"),
    ("howto", "How do I {task}?"),
    ("howto", "What is the best way to {task}?"),
    ("howto", "Give me step-by-step instructions to {task}."),
    ("howto", "I want to {task}. Where should I start?"),
    ("compare", "What is the difference between {a} and {b}?"),
    ("compare", "Compare {a} and {b} in a few sentences."),
    ("list", "List five {things}."),
    ("list", "Suggest some {things} and explain each one briefly."),
    ("write", "Write a short {genre} about {subject}."),
    ("write", "Could you write a {genre} about {subject}?"),
    ("opinion", "What are the pros and cons of {opinion}?"),
    ("opinion", "Is {opinion} a good idea? Give arguments for both sides."),
    ("code", "Write a Python function that {code}."),
    ("code", "Show me how to write a function in Python that {code}, with a short explanation."),
    ("math", "A shop sells {item} for {price} dollars each. How much do {n} {item} cost?"),
    ("math", "{name} has {a_num} {item} and buys {b_num} more, then gives away {c_num}. How many are left?"),
]

GROUNDED_TEMPLATES: list[tuple[str, str]] = [
    ("summarise", "Summarise this text in two sentences.\n\n{passage}"),
    ("summarise", "Give a one-paragraph summary of the following.\n\n{passage}"),
    ("rewrite", "Rewrite the text below so that a ten-year-old can understand it.\n\n{passage}"),
    ("rewrite", "Make the following text shorter and more formal.\n\n{passage}"),
    ("keypoints", "List the key points of this text as bullet points.\n\n{passage}"),
    ("answer", "Based only on the text below, what is the main idea?\n\nText: {passage}"),
    ("answer", "Here is a text:\n\n{passage}\n\nAccording to the text, why does {topic} matter?"),
]

NAMES = ["Sam", "Lena", "Omar", "Priya", "Jonas", "Mei", "Carlos", "Ada", "Tariq", "Nora"]


def _fill(template: str, rng: random.Random) -> str:
    a, b = rng.choice(PAIRS)
    values = {
        "topic": rng.choice(TOPICS),
        "task": rng.choice(TASKS),
        "a": a,
        "b": b,
        "things": rng.choice(THINGS),
        "genre": rng.choice(GENRES),
        "subject": rng.choice(SUBJECTS),
        "opinion": rng.choice(OPINIONS),
        "code": rng.choice(CODE_TASKS),
        "item": rng.choice(ITEMS),
        "price": rng.randint(2, 19),
        "n": rng.randint(2, 12),
        "name": rng.choice(NAMES),
        "a_num": rng.randint(10, 90),
        "b_num": rng.randint(2, 30),
        "c_num": rng.randint(1, 9),
    }
    return template.format(**values)


def _words(text: str) -> list[str]:
    return re.findall(r"[a-z0-9']+", text.lower())


def ngrams(text: str, n: int = 8) -> set[tuple[str, ...]]:
    words = _words(text)
    return {tuple(words[i : i + n]) for i in range(len(words) - n + 1)}


def overlaps(prompt: str, banned: set[tuple[str, ...]], n: int = 8) -> bool:
    """Whether `prompt` shares an n-word sequence with the banned set (or equals a short banned prompt)."""
    return bool(ngrams(prompt, n) & banned)


def bench_ngrams(n: int = 8) -> set[tuple[str, ...]]:
    """Every n-word sequence of every bench prompt (evaluation sets and calibration), plus the prompts
    shorter than n words as whole sequences."""
    from bench.workloads import DATA_DIR, read_jsonl

    banned: set[tuple[str, ...]] = set()
    for path in sorted(DATA_DIR.glob("*.jsonl")):
        for item in read_jsonl(path):
            for key in ("prompt", "passage", "question"):
                text = item.get(key)
                if not text:
                    continue
                banned |= ngrams(text, n)
                words = _words(text)
                if len(words) < n:
                    banned.add(tuple(words))
    return banned


def open_prompts(count: int, seed: int, banned: set[tuple[str, ...]] | None = None) -> list[dict]:
    """`count` distinct open prompts, drawn with `seed`; none overlaps the banned n-grams."""
    rng = random.Random(seed)
    banned = bench_ngrams() if banned is None else banned
    seen: set[str] = set()
    prompts: list[dict] = []
    attempts = 0
    while len(prompts) < count and attempts < count * 50:
        attempts += 1
        kind, template = rng.choice(OPEN_TEMPLATES)
        text = _fill(template, rng)
        if text in seen or overlaps(text, banned) or tuple(_words(text)) in banned:
            continue
        seen.add(text)
        prompts.append({"id": f"open-{len(prompts):05d}", "kind": kind, "prompt": text})
    return prompts


def grounded_prompts(passages: Iterable[tuple[str, str]], seed: int) -> list[dict]:
    """Grounded prompts over (topic, passage) pairs: the passages are the target's own earlier answers."""
    rng = random.Random(seed)
    prompts = []
    for i, (topic, passage) in enumerate(passages):
        kind, template = rng.choice(GROUNDED_TEMPLATES)
        prompts.append(
            {"id": f"grounded-{i:05d}", "kind": kind, "prompt": template.format(passage=passage, topic=topic)}
        )
    return prompts
