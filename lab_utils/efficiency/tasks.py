"""Routing tasks with a checkable answer: a statement to complete and a few options, one of them right.

Each model answers by scoring the options (the option whose tokens it finds most likely after the statement, as
lm-eval scores multiple choice), so every answer is one of the options and is checked by exact match against the
right one. The same answers are compared with the target's own (agreement with the target: the quality a router
keeps). Built from small hand-written tables, shuffled with a seed; the wrong options are plausible words of the
same kind (another capital, another colour), so a model must know the fact, not the word class.
"""
from __future__ import annotations

import random
from dataclasses import dataclass

CAPITALS = [("France", "Paris"), ("Japan", "Tokyo"), ("Italy", "Rome"), ("Spain", "Madrid"), ("Germany", "Berlin"),
            ("Egypt", "Cairo"), ("Russia", "Moscow"), ("England", "London"), ("China", "Beijing"), ("Greece", "Athens")]
OPPOSITES = [("hot", "cold"), ("up", "down"), ("big", "small"), ("day", "night"), ("fast", "slow"), ("old", "new"),
             ("open", "closed"), ("early", "late"), ("light", "dark"), ("happy", "sad")]
FACTS = [("A spider has eight", "legs"), ("A week has seven", "days"), ("Bees make", "honey"),
         ("Cows give", "milk"), ("Fish live in", "water"), ("The sun rises in the", "east"),
         ("The colour of snow is", "white"), ("The colour of grass is", "green"), ("Two plus two equals", "four"),
         ("Romeo and Juliet was written by", "Shakespeare"), ("The largest ocean is the", "Pacific"),
         ("Water freezes at zero degrees", "Celsius"), ("The first letter of the alphabet is", "A"),
         ("The day after Monday is", "Tuesday"), ("The month after January is", "February"),
         ("A triangle has three", "sides"), ("Birds can", "fly"), ("Ice is", "cold"), ("Fire is", "hot"),
         ("The opposite of yes is", "no")]
FACT_DISTRACTORS = {"legs": "wheels", "days": "hours", "honey": "milk", "milk": "honey", "water": "trees",
                    "east": "west", "white": "black", "green": "purple", "four": "seven", "Shakespeare": "Newton",
                    "Pacific": "Arctic", "Celsius": "Kelvin", "A": "Z", "Tuesday": "Sunday",
                    "February": "October", "sides": "wheels", "fly": "swim", "cold": "hot", "hot": "cold",
                    "no": "maybe"}


@dataclass(frozen=True)
class Task:
    prompt: str  # the statement to complete
    options: tuple[str, ...]  # the words a model chooses from (each scored after a space)
    answer: int  # index of the right option: for grading only, never for routing
    kind: str  # "capital", "opposite" or "fact"


def routing_tasks(seed: int = 0) -> list[Task]:
    """Every task of the tables, options shuffled and tasks in a random order (both fixed by `seed`)."""
    rng = random.Random(seed)
    raw = []
    for country, city in CAPITALS:
        other = rng.choice([c for _, c in CAPITALS if c != city])
        raw.append((f"The capital of {country} is", city, other, "capital"))
    for word, opposite in OPPOSITES:
        other = rng.choice([o for _, o in OPPOSITES if o != opposite])
        raw.append((f"The opposite of {word} is", opposite, other, "opposite"))
    for stem, right in FACTS:
        raw.append((stem, right, FACT_DISTRACTORS[right], "fact"))
    tasks = []
    for prompt, right, wrong, kind in raw:
        options = [right, wrong]
        rng.shuffle(options)
        tasks.append(Task(prompt, tuple(options), options.index(right), kind))
    rng.shuffle(tasks)
    return tasks
