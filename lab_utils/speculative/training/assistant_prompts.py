"""Everyday assistant requests (explain, why, how-to, tips, describe, compare, write) built from templates x subjects.

Why: a proposer learns the text it trains on. The chat traffic a served model meets (and lab 07's chat workload)
is generic assistant questions; Wikipedia-title questions and Shakespeare alone leave that style rare, and the
heads then guess well on held-out text like their training text yet poorly on chat. EAGLE and Medusa train on
ShareGPT-like chats for the same reason. Offline, with no such data set, the requests are composed here.

Held out: no request names a subject of lab 07's chat questions (`HELDOUT_WORDS`), so the chat workload stays
unseen; `heldout=True` draws from a separate set of subjects (every 5th of each list) for validation.
"""
from __future__ import annotations

import random
import re

# words of lab 07's chat questions (lab_utils.speculative.training.workloads.QUESTIONS): no training request contains one
HELDOUT_WORDS = ("france", "paris", "cook", "sky", "blue", "hash", "rain", "friend")

CONCEPTS = (
    "photosynthesis", "gravity", "a linked list", "binary search", "inflation", "a vaccine", "democracy", "an API",
    "a black hole", "recursion", "a compiler", "the internet", "electricity", "evolution", "the water cycle",
    "a volcano", "an earthquake", "DNA", "an atom", "a database", "encryption", "machine learning",
    "a spreadsheet", "compound interest", "a mortgage", "climate change", "the phases of the moon", "ocean tides",
    "magnetism", "sound waves", "friction", "a battery", "solar power", "a wind turbine", "a computer virus",
    "a password manager", "a stack data structure", "a queue", "a sorting algorithm", "an operating system",
    "cloud computing", "a search engine", "the stock market", "supply and demand", "a credit score", "meditation",
    "the immune system", "the human heart", "short-term memory", "a symphony", "a sonnet", "a constitution",
    "an election", "a microscope", "a telescope", "plate tectonics", "a rainforest ecosystem", "a coral reef",
    "a neural network", "a web browser", "version control", "a spreadsheet formula", "a budget", "renewable energy",
    "the greenhouse effect", "a thermostat", "an electric car", "a satellite", "a GPS receiver", "a barcode",
    "a QR code", "a transistor", "a CPU", "random access memory", "a firewall", "a URL", "an email server",
    "a regular expression", "object-oriented programming", "a unit test", "a virtual machine", "a loan",
    "an index fund", "a pension", "a museum", "a library card", "first aid", "a healthy sleep routine",
)
WHY = (
    "leaves change colour in autumn", "cats purr", "we dream", "ice floats on water", "birds migrate",
    "people yawn", "the ocean is salty", "we have seasons", "bread rises", "iron rusts", "stars twinkle",
    "planes can fly", "onions make us cry", "the moon changes shape", "we get goosebumps", "metal feels cold",
    "bees make honey", "the sea has waves", "we need sleep", "music gives us chills", "dogs wag their tails",
    "the desert is cold at night", "snowflakes have six sides", "old books smell sweet", "people procrastinate",
    "exercise improves mood", "coffee keeps us awake", "some people are left-handed", "cities are warmer",
    "hiccups happen", "boats float", "we see lightning before we hear thunder", "zebras have stripes",
)
ACTIVITIES = (
    "staying focused while studying", "saving money", "sleeping better", "running a first 5k",
    "writing a resume", "learning to play the guitar", "keeping houseplants alive", "public speaking",
    "starting a vegetable garden", "traveling on a budget", "building a new habit", "learning to swim",
    "writing clearly", "reading more books", "managing stress", "learning to draw", "keeping a tidy desk",
    "preparing for a job interview", "working from home", "taking better photos", "learning a new language",
    "staying healthy in winter", "training a puppy", "making a podcast", "learning to code", "running a meeting",
    "remembering names", "packing for a trip", "writing a short story", "giving feedback", "learning chess",
    "getting up early", "keeping a journal", "teaching a child to ride a bike", "choosing a laptop",
)
TASKS = (
    "change a flat tyre", "write a good essay", "start learning Python", "plan a birthday party",
    "make a budget", "set up a home network", "write a thank-you letter", "choose a good book",
    "prepare for an exam", "start running", "clean a laptop keyboard", "plant a tree", "ask for a raise",
    "write a cover letter", "back up my phone", "learn to type faster", "organize my week", "make new habits stick",
    "pick a strong password", "reduce my screen time", "care for a cactus", "speak more confidently",
    "fix a slow computer", "read a map", "take notes in a lecture", "write a poem", "start a small business",
)
SCENES = (
    "a busy market in the morning", "a quiet forest at dawn", "a snowy mountain village", "a beach at sunset",
    "a crowded train station", "an old library", "a thunderstorm at sea", "a summer festival",
    "a small bakery before opening", "a desert at night", "a football stadium on match day", "a hospital at night",
    "a farm in spring", "a harbour at dawn", "an empty school in the holidays", "a garden after the first frost",
    "a space station orbiting Earth", "a night bus", "a mountain lake", "an airport at midnight",
    "a village square on a Sunday", "a city park in autumn", "a lighthouse in a storm", "a jazz club",
)
ROLES = (
    "teacher", "leader", "neighbour", "team member", "book", "story", "speech", "presentation", "manager",
    "parent", "doctor", "coach", "website", "password", "meal", "holiday", "question", "photograph", "song",
    "library", "job interview", "apology", "city", "museum", "textbook", "game", "scientist", "programmer",
)
COUNTRIES = (
    "Italy", "Japan", "Spain", "Germany", "Egypt", "Brazil", "Canada", "Australia", "India", "Kenya", "Mexico",
    "Norway", "Peru", "Greece", "Turkey", "Thailand", "Argentina", "Ireland", "Portugal", "Sweden", "Vietnam",
    "Morocco", "Chile", "Poland", "Austria", "Hungary", "Denmark", "New Zealand", "South Korea", "Nigeria",
)
CREATIVE = (
    "the sea", "a lost key", "a robot who learns to paint", "the first day of school", "an old lighthouse",
    "a cat who travels", "the moon", "a city at night", "a forgotten letter", "autumn leaves", "a dragon who is shy",
    "a long train journey", "a garden", "a mountain", "winter mornings", "a kind stranger", "a time machine",
    "the last tree on Earth", "a village baker", "a message in a bottle", "a lonely astronaut", "a river",
)
PAIRS = (
    ("a lake", "a sea"), ("weather", "climate"), ("a virus", "a bacterium"), ("speed", "velocity"),
    ("a list", "a tuple"), ("RAM", "storage"), ("a crocodile", "an alligator"), ("tea", "coffee"),
    ("a novel", "a short story"), ("renting", "buying a home"), ("cats", "dogs"), ("trains", "planes"),
    ("a CPU", "a GPU"), ("a debit card", "a credit card"), ("HTTP", "HTTPS"), ("a hurricane", "a tornado"),
    ("a moth", "a butterfly"), ("baking soda", "baking powder"), ("a poem", "a song"), ("a city", "a town"),
)
THINGS = (
    "fruits and their colours", "animals that live in the ocean", "musical instruments", "famous inventors",
    "healthy breakfast ideas", "board games for a family", "ways to save energy at home", "uses of a computer",
    "planets in the solar system", "hobbies to try", "kinds of clouds", "birds found in gardens",
    "things to pack for a hike", "countries in Africa", "programming languages", "ways to relax",
    "famous paintings", "sports played with a ball", "vegetables that grow fast", "parts of a flower",
)

TEMPLATES: tuple[tuple[str, tuple], ...] = (
    ("Explain what {x} is.", CONCEPTS), ("What is {x}?", CONCEPTS), ("How does {x} work?", CONCEPTS),
    ("Explain {x} in simple terms.", CONCEPTS), ("Explain {x} to a child.", CONCEPTS),
    ("What is {x} used for?", CONCEPTS), ("Why is {x} important?", CONCEPTS),
    ("Explain why {x}.", WHY), ("Why is it that {x}?", WHY), ("Can you tell me why {x}?", WHY),
    ("Give three tips for {x}.", ACTIVITIES), ("What are some good ways of {x}?", ACTIVITIES),
    ("I need advice on {x}. Where should I start?", ACTIVITIES), ("How do I {x}?", TASKS),
    ("What is the best way to {x}?", TASKS), ("Give me step-by-step instructions to {x}.", TASKS),
    ("Describe {x}.", SCENES), ("Write a short description of {x}.", SCENES),
    ("What makes a good {x}?", ROLES), ("What are the qualities of a great {x}?", ROLES),
    ("What is the capital of {x} and what is it known for?", COUNTRIES), ("Tell me about the culture of {x}.", COUNTRIES),
    ("What should a tourist see in {x}?", COUNTRIES), ("Write a short poem about {x}.", CREATIVE),
    ("Write a haiku about {x}.", CREATIVE), ("Write a short story about {x}.", CREATIVE),
    ("What is the difference between {x}?", PAIRS), ("Compare {x}.", PAIRS), ("List five {x}.", THINGS),
    ("Name a few {x}.", THINGS),
)


def _fill(template: str, subject) -> str:
    x = " and ".join(subject) if isinstance(subject, tuple) else subject
    return template.format(x=x)


_HELDOUT = re.compile(r"\b(" + "|".join(HELDOUT_WORDS) + ")", re.IGNORECASE)  # also "cooking", "rainy"


def _is_clean(text: str) -> bool:
    return not _HELDOUT.search(text)


SUFFIXES = ("", " Keep it short.", " Answer in two or three sentences.", " Use simple words.")


def assistant_requests(n: int, offset: int = 0, seed: int = 0, heldout: bool = False) -> list[str]:
    """Requests number `offset` .. `offset + n - 1` of one seeded order of every (template, subject, suffix)
    of the split: every request once with no suffix before any repeats with one, so shards hold no duplicates.

    Every 5th subject of each list is held out (`heldout=True`); no request names a subject of lab 07's chat
    questions."""
    combos = [_fill(t, x) for t, subjects in TEMPLATES for i, x in enumerate(subjects) if (i % 5 == 4) == heldout]
    combos = sorted({c[0].upper() + c[1:] for c in combos if _is_clean(c)})
    rng = random.Random(f"assistant-{seed}-{heldout}")
    order: list[str] = []
    for suffix in SUFFIXES:
        rng.shuffle(combos)
        order += [c + suffix for c in combos]
    if offset + n > len(order):
        raise ValueError(f"only {len(order)} distinct requests in this split: asked for {offset}..{offset + n - 1}")
    return order[offset: offset + n]
