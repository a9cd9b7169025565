"""A seeded set of small "reply in JSON" tasks, and the check that an output is valid for its schema.

Each task gives the facts in plain words and asks for a JSON object with given keys; its schema bounds every
value (string lengths, integer ranges, enums), so a valid answer is at most a few dozen tokens and a
constrained engine always finishes within `max_tokens`. Lab 13 and the structured-output tests use it: the
schema-valid rate with the prompt alone vs with the grammar, same prompts, same model.
"""
from __future__ import annotations

import json
import random
from dataclasses import dataclass

NAMES = ["Alice", "Bruno", "Chen", "Dana", "Emeka", "Farah", "Goran", "Hana", "Ivan", "Julia", "Kofi", "Lena"]
CITIES = ["Paris", "Lagos", "Osaka", "Lima", "Oslo", "Cairo", "Quito", "Perth", "Seoul", "Dublin"]
PRODUCTS = ["desk lamp", "kettle", "backpack", "headphones", "notebook", "bicycle", "umbrella", "mug"]
DAYS = ["monday", "tuesday", "wednesday", "thursday", "friday", "saturday", "sunday"]
CONDITIONS = ["sunny", "cloudy", "rain", "snow"]
PRIORITIES = ["low", "medium", "high"]
TASKS = ["buy milk", "call the bank", "fix the door", "send the report", "water the plants", "book a flight"]
BOOKS = [("Dune", "Frank Herbert", 1965), ("Emma", "Jane Austen", 1815), ("Beloved", "Toni Morrison", 1987),
         ("Ulysses", "James Joyce", 1922), ("Kindred", "Octavia Butler", 1979), ("Walden", "Henry Thoreau", 1854)]


def _str(max_len: int = 24) -> dict:
    return {"type": "string", "minLength": 1, "maxLength": max_len}


def _int(lo: int, hi: int) -> dict:
    return {"type": "integer", "minimum": lo, "maximum": hi}


def _obj(props: dict) -> dict:
    return {"type": "object", "properties": props, "required": list(props), "additionalProperties": False}


@dataclass(frozen=True)
class JsonTask:
    task_id: str
    kind: str
    question: str  # the facts and the keys wanted, in words
    schema: dict
    expected: dict  # the facts as the ideal answer (extraction accuracy; validity needs only the schema)

    def messages(self) -> list[dict]:
        """Chat messages asking for JSON with the keys and their types in words (the same prompt with and
        without the grammar; spelling out the whole schema makes a 135M model copy the schema back)."""
        keys = [f'"{k}" ({_describe(v)})' for k, v in self.schema["properties"].items()]
        return [{"role": "user", "content": f"{self.question} Reply with only a JSON object with the keys "
                                            f"{', '.join(keys[:-1])} and {keys[-1]}."}]


def _describe(prop: dict) -> str:
    if "enum" in prop:
        return "one of " + "/".join(prop["enum"])
    return {"string": "text", "integer": "a whole number", "boolean": "true or false"}.get(prop["type"], prop["type"])


def _person(rng: random.Random, i: int) -> JsonTask:
    name, city, age = rng.choice(NAMES), rng.choice(CITIES), rng.randint(18, 90)
    return JsonTask(f"person-{i}", "person", f"{name} is {age} years old and lives in {city}. Give their name, "
                    f"age and city.", _obj({"name": _str(), "age": _int(0, 120), "city": _str()}),
                    {"name": name, "age": age, "city": city})


def _product(rng: random.Random, i: int) -> JsonTask:
    item, price, stock = rng.choice(PRODUCTS), rng.randint(3, 400), rng.random() < 0.5
    words = "is in stock" if stock else "is sold out"
    return JsonTask(f"product-{i}", "product", f"The {item} costs {price} dollars and {words}. Give the product, "
                    f"its price in dollars and whether it is in stock.",
                    _obj({"product": _str(), "price": _int(0, 10000), "in_stock": {"type": "boolean"}}),
                    {"product": item, "price": price, "in_stock": stock})


def _event(rng: random.Random, i: int) -> JsonTask:
    name, day, n = rng.choice(NAMES), rng.choice(DAYS), rng.randint(2, 300)
    return JsonTask(f"event-{i}", "event", f"{name}'s party is on {day.title()} with {n} guests. Give the host, "
                    f"the day and the number of guests.",
                    _obj({"host": _str(), "day": {"type": "string", "enum": DAYS}, "guests": _int(1, 1000)}),
                    {"host": name, "day": day, "guests": n})


def _book(rng: random.Random, i: int) -> JsonTask:
    title, author, year = rng.choice(BOOKS)
    return JsonTask(f"book-{i}", "book", f"{title} was written by {author} in {year}. Give the title, author and "
                    f"year.", _obj({"title": _str(), "author": _str(), "year": _int(1000, 2100)}),
                    {"title": title, "author": author, "year": year})


def _weather(rng: random.Random, i: int) -> JsonTask:
    city, t, cond = rng.choice(CITIES), rng.randint(-20, 40), rng.choice(CONDITIONS)
    return JsonTask(f"weather-{i}", "weather", f"In {city} it is {t} degrees Celsius with {cond}. Give the city, "
                    f"the temperature and the condition.",
                    _obj({"city": _str(), "temperature_c": _int(-60, 60),
                          "condition": {"type": "string", "enum": CONDITIONS}}),
                    {"city": city, "temperature_c": t, "condition": cond})


def _todo(rng: random.Random, i: int) -> JsonTask:
    task, prio, done = rng.choice(TASKS), rng.choice(PRIORITIES), rng.random() < 0.5
    state = "already done" if done else "not done yet"
    return JsonTask(f"todo-{i}", "todo", f"The task '{task}' has {prio} priority and is {state}. Give the task, "
                    f"its priority and whether it is done.",
                    _obj({"task": _str(32), "priority": {"type": "string", "enum": PRIORITIES},
                          "done": {"type": "boolean"}}),
                    {"task": task, "priority": prio, "done": done})


MAKERS = (_person, _product, _event, _book, _weather, _todo)


def json_tasks(n: int = 60, seed: int = 0) -> list[JsonTask]:
    """`n` tasks, the six kinds in turn, facts drawn with `random.Random(seed)` (same seed, same tasks)."""
    if n < 1:
        raise ValueError(f"n={n} must be >= 1")
    rng = random.Random(seed)
    return [MAKERS[i % len(MAKERS)](rng, i) for i in range(n)]


def schema_valid(text: str, schema: dict) -> bool:
    """True if `text` is one JSON value (surrounding whitespace allowed) that satisfies `schema`."""
    import jsonschema

    try:
        value = json.loads(text)
    except ValueError:
        return False
    return jsonschema.Draft202012Validator(schema).is_valid(value)


def extract_json(text: str):
    """The first JSON object found anywhere in `text` (inside code fences, after chatter), or None: a lenient
    reading that a program could still use, next to `schema_valid`'s strict one."""
    decoder = json.JSONDecoder()
    start = text.find("{")
    while start != -1:
        try:
            return decoder.raw_decode(text, start)[0]
        except ValueError:
            start = text.find("{", start + 1)
    return None


def lenient_valid(text: str, schema: dict) -> bool:
    """True if a JSON object somewhere in `text` satisfies `schema`."""
    import jsonschema

    value = extract_json(text)
    return value is not None and jsonschema.Draft202012Validator(schema).is_valid(value)
