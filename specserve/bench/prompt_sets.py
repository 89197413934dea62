"""Prompt sets that exist offline, all built here: the benchmark workloads (code editing
on standard-library functions, chat questions written for the project) and a larger,
generated set for training draft models (chat questions from topic lists × question
templates, writing and maths tasks, code tasks and explain/summarise/rewrite tasks over
standard-library source and docstrings).

Every prompt is a user message; callers apply the model's chat template. The split is
deterministic and made by *source* (the topic, the function, the documented object), so
no held-out prompt shares its subject with a training prompt: a SHA-256 of the source's
name puts it in ``test`` (held out: never trained on, used for the reported figures;
10 %), ``val`` (not trained on, watched during training; 5 %) or ``train``. The benchmark
workloads are always ``test``, and their functions never appear in other prompts.

The standard-library texts are read from the running Python, so the generated set differs
slightly between Python versions (3.11 here, 3.12 on the GPU machines); the split rule and
the seed are what stay fixed.
"""
from __future__ import annotations

import calendar
import colorsys
import fnmatch
import hashlib
import heapq
import importlib
import inspect
import random
import shlex
import string
import textwrap
from dataclasses import dataclass

TEST_PERCENT, VAL_PERCENT = 10, 5


@dataclass(frozen=True)
class Prompt:
    kind: str      # "chat" or "code"
    text: str      # the user message
    source: str    # what the split is keyed on (topic, function, document)
    split: str     # "train" | "val" | "test" (held out)

    @property
    def held_out(self) -> bool:
        return self.split == "test"


def split_of(source: str) -> str:
    bucket = int.from_bytes(hashlib.sha256(source.encode()).digest()[:4], "big") % 100
    if bucket >= 100 - TEST_PERCENT:
        return "test"
    return "val" if bucket >= 100 - TEST_PERCENT - VAL_PERCENT else "train"


# ---------------------------------------------------------------------------- benchmarks
# Code editing: the answer repeats most of the input, as real editing requests do.
_CODE_TASKS = [
    ("Add type hints to this function and return the full edited code:", textwrap.dedent),
    ("Rename the variables of this function to clearer names and return the full code:", heapq.nsmallest),
    ("Add a docstring to this function and return the full edited code:", colorsys.rgb_to_hls),
    ("Rewrite this function without changing its behaviour, adding comments:", shlex.quote),
    ("Add type hints to this function and return the full edited code:", string.capwords),
    ("Add input validation to this function and return the full edited code:", textwrap.indent),
    ("Add a docstring to this function and return the full edited code:", fnmatch.filter),
    ("Rewrite this function using early returns and return the full code:", calendar.monthrange),
]

CODE_EDITING = [f"{task}\n\n```python\n{inspect.getsource(fn)}```" for task, fn in _CODE_TASKS]

CHAT = [
    "What is the capital of France, and what is it famous for?",
    "Give me three tips for writing clear technical documentation.",
    "Explain the difference between a process and a thread.",
    "How does a hash table handle collisions?",
    "What are the benefits of regular exercise?",
    "Summarise the plot of Romeo and Juliet in three sentences.",
    "Why is the sky blue?",
    "Write a short poem about the sea.",
]

WORKLOADS = {"code-edit": CODE_EDITING, "chat": CHAT}

_BENCHMARK_FUNCTIONS = {f"{fn.__module__}.{fn.__qualname__}" for _, fn in _CODE_TASKS}


def chat_prompts(tokenizer, messages: list[str]) -> list[str]:
    """Apply the chat template to each user message (as text, generation prompt added)."""
    return [tokenizer.apply_chat_template([{"role": "user", "content": m}], tokenize=False,
                                          add_generation_prompt=True) for m in messages]


# ---------------------------------------------------------------------------- chat
_TOPICS = {
    "science": ["photosynthesis", "black holes", "plate tectonics", "the water cycle", "DNA replication",
                "vaccines", "climate change", "the periodic table", "gravity", "evolution by natural selection",
                "the immune system", "solar eclipses", "ocean tides", "volcanoes", "antibiotics",
                "the speed of light", "electric circuits", "magnetism", "the greenhouse effect", "earthquakes",
                "the human heart", "sleep", "nuclear fusion", "rainbows", "bacteria and viruses"],
    "technology": ["how the internet works", "public-key cryptography", "machine learning", "databases",
                   "cloud computing", "operating systems", "compilers", "version control with git",
                   "HTTP and HTTPS", "DNS", "containers and Docker", "unit testing", "garbage collection",
                   "REST APIs", "caching", "recursion", "binary search", "sorting algorithms",
                   "regular expressions", "linked lists", "big-O notation", "neural networks",
                   "solid-state drives", "Wi-Fi", "GPUs", "password hashing", "load balancers",
                   "functional programming", "object-oriented programming", "concurrency and locks"],
    "history": ["the Roman Empire", "the printing press", "the Industrial Revolution", "ancient Egypt",
                "the French Revolution", "the Renaissance", "the Silk Road", "the Apollo moon landing",
                "the invention of the telephone", "the Great Wall of China", "the Vikings",
                "the fall of the Berlin Wall", "the history of the bicycle", "the Olympic Games"],
    "geography": ["the Amazon rainforest", "the Sahara desert", "the Himalayas", "Japan", "Canada",
                  "the river Nile", "Australia", "Iceland", "the Mediterranean Sea", "Antarctica",
                  "Brazil", "Switzerland", "the Pacific Ocean", "Mexico City"],
    "health": ["healthy eating", "drinking enough water", "stress management", "stretching", "meditation",
               "running for beginners", "good posture", "vitamin D", "a balanced breakfast", "screen time"],
    "everyday": ["saving money", "learning a new language", "time management", "public speaking",
                 "job interviews", "moving to a new city", "keeping houseplants alive", "cooking pasta",
                 "baking bread", "planning a trip", "writing a CV", "starting a vegetable garden",
                 "remote work", "making friends as an adult", "cleaning a kitchen", "choosing a laptop",
                 "learning to play the guitar", "reading more books", "training a puppy", "recycling"],
    "economics": ["inflation", "interest rates", "supply and demand", "compound interest", "stock markets",
                  "budgeting", "taxes", "international trade", "cryptocurrencies", "insurance"],
    "nature": ["honeybees", "octopuses", "migrating birds", "coral reefs", "wolves", "elephants",
               "mushrooms", "tropical storms", "deserts at night", "penguins", "rivers and deltas", "cats"],
    "space": ["the Moon", "Mars", "the International Space Station", "the Big Bang", "exoplanets",
              "the Sun", "telescopes", "the Milky Way", "satellites", "space suits"],
    "food": ["sourdough", "fermentation", "spices", "chocolate", "olive oil", "sushi", "coffee roasting",
             "vegetarian cooking", "meal planning", "food safety"],
    "sports": ["football", "chess", "swimming", "marathon training", "tennis", "yoga", "rock climbing",
               "cycling", "basketball", "the rules of cricket"],
    "mind": ["habits", "motivation", "memory", "procrastination", "curiosity", "critical thinking",
             "emotional intelligence", "learning from mistakes", "creativity", "decision making"],
    "arts": ["impressionist painting", "jazz", "Shakespeare's plays", "photography", "poetry",
             "classical music", "film editing", "architecture", "origami", "the novel as a form"],
}

_QUESTION_TEMPLATES = [
    "What is {t}?", "Explain {t} in simple terms.", "Explain {t} to a ten-year-old.",
    "Give me three interesting facts about {t}.", "Why does {t} matter?",
    "What are the most common misconceptions about {t}?", "Write a short paragraph about {t}.",
    "Summarise what everyone should know about {t}.", "What are the pros and cons of {t}?",
    "How would you teach {t} to a beginner?", "List five key terms related to {t} and define each.",
    "What is the history of {t}?", "Write a haiku about {t}.", "Give me a short quiz about {t}.",
    "Describe {t} in one sentence, then in one paragraph.", "What questions should I ask to learn about {t}?",
    "Can you give me an analogy that explains {t}?", "What are good first steps to get started with {t}?",
    "Write a short story that involves {t}.", "What do experts disagree about regarding {t}?",
    "I want to get better at understanding {t}. Where should I start?",
    "What are common mistakes people make about {t}?", "Tell me something surprising about {t}.",
    "How has {t} changed over time?", "Write a short blog post introduction about {t}.",
]

_COMPARISONS = [("a process", "a thread"), ("a list", "a tuple in Python"), ("TCP", "UDP"),
                ("weather", "climate"), ("a virus", "a bacterium"), ("stocks", "bonds"),
                ("RAM", "storage"), ("speed", "velocity"), ("a comet", "an asteroid"),
                ("SQL", "NoSQL databases"), ("renting", "buying a home"), ("tea", "coffee"),
                ("a compiler", "an interpreter"), ("mitosis", "meiosis"), ("Python", "JavaScript"),
                ("a democracy", "a republic"), ("baking soda", "baking powder"), ("AC", "DC current"),
                ("a crocodile", "an alligator"), ("git merge", "git rebase")]

_WRITING = [
    "Write a short poem about {t}.", "Write a polite email asking my manager for a day off on {d}.",
    "Write a limerick about {t}.", "Write a product description for {p}.",
    "Write a motivational message for someone who is learning {t}.",
    "Write a thank-you note to a friend who gave me {p}.", "Write a two-sentence horror story about {p}.",
    "Write a tweet announcing {p}.", "Write a short dialogue between a teacher and a student about {t}.",
]
_THEMES = ["the sea", "autumn leaves", "a city at night", "friendship", "the first snow", "a lost key",
           "the moon", "an old library", "morning coffee", "a long train journey", "mountains",
           "a rainy afternoon", "the desert", "a lighthouse", "spring flowers", "a quiet forest"]
_PRODUCTS = ["a reusable water bottle", "a smart lamp", "a mechanical keyboard", "a hiking backpack",
             "a cookbook", "noise-cancelling headphones", "a board game", "a houseplant", "a bicycle",
             "a fountain pen", "a travel mug", "a weather app"]
_DAYS = ["Monday", "Friday", "the 3rd of May", "next Tuesday", "the day after the holiday"]


def _math_problems(rng: random.Random, count: int) -> list[tuple[str, str]]:
    forms = [
        ("A shop sells pencils at {a} cents each. How much do {b} pencils cost? Explain your steps.", "arith"),
        ("A train travels {a} km in {b} hours. What is its average speed?", "speed"),
        ("If I save {a} dollars every week, how long does it take to save {c} dollars?", "saving"),
        ("What is {a} multiplied by {b}? Show the working.", "mul"),
        ("A rectangle is {a} cm long and {b} cm wide. What are its area and perimeter?", "rect"),
        ("Convert {a} degrees Celsius to Fahrenheit and explain the formula.", "temp"),
        ("What is {b} percent of {c}?", "percent"),
        ("Solve for x: {a}x + {b} = {c}.", "linear"),
    ]
    out = []
    for i in range(count):
        text, name = forms[i % len(forms)]
        a, b = rng.randint(2, 60), rng.randint(2, 40)
        out.append((text.format(a=a, b=b, c=rng.randint(100, 2000)), f"math:{name}:{i}"))
    return out


def _chat_prompts(rng: random.Random) -> list[tuple[str, str]]:
    out = []
    for group in _TOPICS.values():
        for topic in group:
            for template in rng.sample(_QUESTION_TEMPLATES, 16):
                out.append((template.format(t=topic), f"topic:{topic}"))
    for a, b in _COMPARISONS:
        for template in ("What is the difference between {a} and {b}?", "Compare {a} and {b}.",
                         "When should I choose {a} over {b}?"):
            out.append((template.format(a=a, b=b), f"compare:{a}|{b}"))
    for i, template in enumerate(_WRITING):
        for theme in rng.sample(_THEMES, 5):
            text = template.format(t=theme, p=rng.choice(_PRODUCTS), d=rng.choice(_DAYS))
            out.append((text, f"writing:{theme}"))
    return out + _math_problems(rng, 160)


# ---------------------------------------------------------------------------- code
_STDLIB_MODULES = (
    "textwrap heapq colorsys shlex string fnmatch calendar bisect fractions statistics json.encoder "
    "json.decoder csv difflib functools collections operator random base64 html urllib.parse "
    "ipaddress datetime posixpath ntpath glob copy pprint reprlib enum dataclasses argparse gettext "
    "email.utils http.cookies mimetypes quopri zipfile tarfile gzip shutil tempfile filecmp "
    "configparser plistlib uuid secrets hmac numbers decimal re tokenize keyword ast dis inspect "
    "traceback warnings contextlib types typing queue sched selectors codecs graphlib zoneinfo "
    "pathlib logging threading"
).split()

_CODE_TEMPLATES = [
    "Add type hints to this function and return the full edited code:",
    "Add a docstring to this function and return the full edited code:",
    "Explain what this function does, step by step:",
    "Rename the variables of this function to clearer names and return the full code:",
    "Write three unit tests with pytest for this function:",
    "Rewrite this function to be easier to read, keeping its behaviour:",
    "Add comments to this function and return the full code:",
    "Summarise what this function does in two sentences:",
    "Are there any bugs or edge cases in this function? Explain.",
    "Rewrite this function using early returns and return the full code:",
    "Add input validation to this function and return the full edited code:",
    "Describe the time complexity of this function:",
]

_DOC_TEMPLATES = [
    "Summarise this documentation in plain English:",
    "Explain this documentation to a beginner programmer:",
    "Rewrite this text to be shorter and clearer:",
    "Write a usage example for the function documented here:",
    "List the key points of this documentation as bullet points:",
    "Turn this documentation into a short FAQ with three questions and answers:",
]

_WRITE_CODE = [
    "reverses a string", "checks whether a number is prime", "counts the words in a text",
    "merges two sorted lists", "flattens a nested list", "returns the n-th Fibonacci number",
    "removes duplicates from a list while keeping order", "parses a date in ISO format",
    "computes the factorial of a number", "checks whether a string is a palindrome",
    "finds the most common element in a list", "converts a temperature from Celsius to Fahrenheit",
    "reads a CSV file and returns its rows as dictionaries", "computes the average of a list of numbers",
    "groups a list of words by their first letter", "validates an email address with a regular expression",
    "splits a list into chunks of size n", "returns the transpose of a matrix",
    "counts the vowels in a string", "implements binary search on a sorted list",
    "sorts a list of dictionaries by a key", "finds all anagrams of a word in a list",
    "computes the greatest common divisor of two numbers", "converts a Roman numeral to an integer",
    "checks whether brackets in a string are balanced", "rotates a list by k positions",
    "returns the second largest number in a list", "capitalises every word in a sentence",
    "downloads nothing but builds a URL with query parameters", "implements a simple stack class",
    "implements a queue with two stacks", "computes the running sum of a list",
    "finds the longest common prefix of a list of strings", "converts a number to binary",
    "counts the lines in a file", "implements a least-recently-used cache",
    "checks whether two strings are anagrams", "generates all permutations of a list",
    "computes the dot product of two vectors", "returns the intersection of two lists",
]
_WRITE_CODE_TEMPLATES = [
    "Write a Python function that {t}.", "Write a Python function that {t}, with a docstring and type hints.",
    "How do I write code that {t} in Python? Explain briefly.", "Write a JavaScript function that {t}.",
]


def _stdlib_functions() -> list[tuple[str, str, str]]:
    """(qualified name, source, docstring) of small module-level functions and methods."""
    out = []
    for module_name in _STDLIB_MODULES:
        try:
            module = importlib.import_module(module_name)
        except ImportError:
            continue
        for name, obj in sorted(vars(module).items()):
            if name.startswith("_"):
                continue
            members = [(name, obj)]
            if inspect.isclass(obj) and obj.__module__ == module.__name__:
                members = [(f"{name}.{m}", f) for m, f in sorted(vars(obj).items())
                           if inspect.isfunction(f) and not m.startswith("__")]
            for qualname, fn in members:
                if not inspect.isfunction(fn) or fn.__module__ != module.__name__:
                    continue
                try:
                    source = textwrap.dedent(inspect.getsource(fn))
                except (OSError, TypeError):
                    continue
                full = f"{module.__name__}.{qualname}"
                if 5 <= source.count("\n") <= 40 and full not in _BENCHMARK_FUNCTIONS:
                    out.append((full, source, inspect.getdoc(fn) or ""))
    return out


def _code_prompts(rng: random.Random) -> list[tuple[str, str]]:
    out = []
    for name, source, doc in _stdlib_functions():
        for template in rng.sample(_CODE_TEMPLATES, 3):
            out.append((f"{template}\n\n```python\n{source}```", f"function:{name}"))
        if len(doc) > 120:
            out.append((f"{rng.choice(_DOC_TEMPLATES)}\n\n{doc}", f"function:{name}"))
    for task in _WRITE_CODE:
        for template in rng.sample(_WRITE_CODE_TEMPLATES, 2):
            out.append((template.format(t=task), f"write:{task}"))
    return out


# ---------------------------------------------------------------------------- the whole set
def build_prompt_set(seed: int = 0) -> list[Prompt]:
    """The benchmark workloads (held out) and the generated set, split by source; the
    same seed and Python version give the same list."""
    rng = random.Random(seed)
    prompts = [Prompt("chat", text, f"benchmark:chat:{i}", "test") for i, text in enumerate(CHAT)]
    prompts += [Prompt("code", text, f"benchmark:code:{i}", "test") for i, text in enumerate(CODE_EDITING)]
    seen = {p.text for p in prompts}
    for kind, items in (("chat", _chat_prompts(rng)), ("code", _code_prompts(rng))):
        for text, source in items:
            if text not in seen:
                seen.add(text)
                prompts.append(Prompt(kind, text, source, split_of(source)))
    return prompts


def held_out_prompts(kind: str, count: int, seed: int = 0) -> list[str]:
    """The first ``count`` held-out prompts of ``kind`` ("chat" or "code"): the benchmark
    workload's prompts first, then generated ones in a fixed shuffled order."""
    chosen = [p for p in build_prompt_set(seed) if p.held_out and p.kind == kind]
    bench = [p.text for p in chosen if p.source.startswith("benchmark:")]
    rest = [p.text for p in chosen if not p.source.startswith("benchmark:")]
    random.Random(seed + 1).shuffle(rest)
    return (bench + rest)[:count]
