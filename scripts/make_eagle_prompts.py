"""More training instructions for `specdec train-eagle`, built from the project's own templates.

The EAGLE head is data-bound (distinct prompts are what lifted its held-out accuracy:
docs/decisions/012-eagle-head.md), and hand-written prompts come slowly. This script crosses task
templates with topics, fills arithmetic word problems with random numbers, and adds code, factoid
and German->English requests: a few thousand distinct instructions, every word written for this
project (no dataset text, no Spec-Bench question). Deterministic for a seed.

    python scripts/make_eagle_prompts.py --n 1900 --seed 1 > prompts-gen.txt

With ``--passages ANSWERS --tokenizer DIR`` it writes instead (as JSONL, for prompts that span lines)
requests over the target's own earlier answers: summarize, list the key points, simplify, and answer
a question from two documents, so the head also learns the long-context, copy-heavy turns of
summarization and retrieval-augmented QA.

    python scripts/make_eagle_prompts.py --passages data/eagle_answers.jsonl \
        --tokenizer TOKENIZER_DIR > prompts-passages.jsonl

TOKENIZER_DIR is any directory ``AutoTokenizer.from_pretrained`` reads for the target (for the default
model, the converted model directory ``specdec.models.load_model("default")`` caches).
"""

from __future__ import annotations

import argparse
import json
import random
import re

TOPICS = """volcanoes; the printing press; coral reefs; electric cars; sourdough bread; chess; the human heart;
black holes; recycling; jazz; the Silk Road; photosynthesis; honeybees; remote work; the French Revolution;
machine learning; rainforests; the stock market; vaccines; 3D printing; the Moon landing; climate change;
public libraries; marathon training; urban gardening; the Great Wall of China; antibiotics; solar panels;
social media; the Olympic Games; octopuses; the immune system; ancient Egypt; blockchains; earthquakes;
classical music; coffee; the internet; glaciers; the Renaissance; electric guitars; sleep; deserts; robots;
bicycles; the periodic table; dinosaurs; wind turbines; ocean tides; meditation; board games;
video game design; nuclear energy; wolves; smartphones; mountain climbing; space telescopes;
the human brain; origami; penguins; the Industrial Revolution; microplastics; volunteering;
public transport; cryptography; hurricanes; the violin; vitamins; gothic cathedrals; the Amazon river;
cloud computing; first aid; budget travel; organic farming; lightning; the Vikings; electric circuits; yoga;
newspapers; elephants; self-driving cars; composting; the Milky Way; podcasts; mushrooms; the Cold War;
airplanes; cheese making; DNA; city parks; rivers; time management; the Mars rovers; suspension bridges;
learning a second language; museums; sharks; friendship; the ozone layer; online privacy; street food;
high-speed trains; tornadoes; the Aztecs; magnets; knitting; snowflakes; evolution; submarines;
birdwatching; the Olympic marathon; spices; the moon's phases; typewriters; ancient Greek theatre;
rainbows; minimalism; volcanic islands; kites; the metric system; lighthouses; honey; chocolate;
water purification; the Sahara; open-source software; the stock of fish in the oceans; paper money;
bees' dances; antique clocks; opera; public speaking; camping; the postal service; glass blowing""".split(";")

TEMPLATES = """Explain {t} to a high school student.
Write a short story in which {t} plays an important part.
Write a poem about {t}.
List five interesting facts about {t}.
What are the advantages and disadvantages of {t}?
Write a persuasive paragraph about why people should care about {t}.
Give a brief history of {t}.
Write a news report about a new discovery related to {t}.
Pretend you are a tour guide and introduce {t} to a group of visitors.
Write an email to a friend recommending a documentary about {t}.
Create a quiz with three questions about {t}, with the answers.
Summarize what everyone should know about {t} in three bullet points.
Write a dialogue between a teacher and a curious student about {t}.
Describe {t} to someone living in the year 1800.
What are common misconceptions about {t}?
Write a product description for a children's book about {t}.
Outline a five-minute presentation on {t}.
What open questions do scientists or historians still have about {t}?
Write a fun fact about {t} in one sentence.
You are an expert on {t}. Answer a reporter who asks how you became interested in the field.
Write a blog post introduction about {t}.
Explain {t} using an analogy from everyday life.
Write a limerick about {t}.
What careers are connected to {t}? Name three and describe them briefly.
Compare {t} today with {t} fifty years ago.
Write a short speech for a school assembly about {t}.
Give step-by-step advice for a beginner who wants to learn about {t}.
Write the first paragraph of an encyclopedia article about {t}.
How might {t} change in the next twenty years?
Write a diary entry from the point of view of someone who just learned about {t}.
Explain the science behind {t} in simple terms.
Write three discussion questions about {t} for a book club.
Describe a museum exhibition about {t}.
What would a world without {t} look like?
Write a haiku about {t}, then explain its imagery.
Give a one-paragraph summary of {t} for a busy executive.
Write a job advertisement for a researcher who studies {t}.
Explain {t} in exactly three sentences.
Write a short scene for a play set in a place connected to {t}.
What should a journalist ask when writing about {t}? List five questions.""".splitlines()

NAMES = ["Maria", "Tom", "Aisha", "Kenji", "Lucia", "Omar", "Grace", "Pavel", "Nina", "Samuel", "Ines", "Ravi",
         "Chloe", "Diego", "Hannah", "Yusuf", "Elena", "Felix", "Mei", "Jonas"]
ITEMS = ["apples", "pencils", "stickers", "marbles", "cookies", "books", "stamps", "shells", "cards", "eggs"]

MATH = [
    "{n} buys {a} boxes of {i} with {b} {i} in each box and gives {c} {i} to a friend. How many {i} does {n} have now?",
    "A shop sells {i} for ${a} each. {n} buys {b} of them and pays with a ${p} bill. How much change does {n} get?",
    "{n} reads {a} pages a day. The book has {q} pages. How many days does {n} need to finish it?",
    "A train leaves at {h}:00 and travels {s} km per hour for {b} hours. How far does it go?",
    "{n} earns ${w} an hour and works {a} hours a week. How much does {n} earn in {b} weeks?",
    "A class has {q} students. {a} out of every 10 students walk to school. How many students walk?",
    "{n} had {q} {i}. {n} sold half of them and then bought {a} more. How many {i} does {n} have?",
    "A rectangle is {a} cm wide and {b} cm long. What are its area and its perimeter?",
    "{n} saves ${a} every week. How many weeks does it take to save ${p}?",
    "A recipe needs {a} eggs for {b} people. How many eggs are needed for {c} people? Show your steps.",
    "{n} runs {a} km on Monday, {b} km on Wednesday and {c} km on Friday. What is the average distance per run?",
    "There are {q} seats in a theatre and {p} tickets were sold for each of {b} shows, but the theatre was full "
    "only once. Is that possible? Explain.",
    "A bag holds {a} red balls and {b} blue balls. What is the probability of drawing a red ball?",
    "{n} is {a} years old. {n}'s mother is {b} times as old. How old will the mother be in {c} years?",
]

CODE_TASKS = """reverses the words in a sentence; counts the vowels in a string; returns the n-th Fibonacci number;
checks whether a year is a leap year; merges two sorted lists; removes duplicates from a list while keeping order;
finds the largest number in a list without using max; converts Celsius to Fahrenheit; checks whether two words are
anagrams; flattens a nested list; counts how often each word appears in a text; validates an email address with a
regular expression; computes the factorial of a number recursively; returns the prime numbers below n; transposes
a matrix; finds the second largest element of a list; capitalizes the first letter of every word; implements
binary search; reads a CSV file and prints the average of a column; converts a number to Roman numerals;
computes the greatest common divisor of two numbers; checks whether parentheses in a string are balanced;
rotates a list by k positions; returns the longest word in a sentence; sorts a list of dictionaries by a key;
implements a stack class with push, pop and peek; computes the median of a list; converts a binary string to an
integer; groups a list of words by their first letter; chunks a list into pieces of size n""".split(";")
LANGS = ["Python", "Python", "JavaScript", "Java", "C", "Go"]

FACTOID = """who invented the telephone; what is the capital of australia; how many bones are in the human body;
when did the first world war end; what is the largest planet in the solar system; who painted the mona lisa;
what language is spoken in brazil; how far is the moon from the earth; what is the boiling point of water in
fahrenheit; who wrote romeo and juliet; what is the longest river in africa; how many players are on a soccer
team; what is the chemical symbol for gold; when was the eiffel tower built; who discovered penicillin;
what is the smallest country in the world; how many continents are there; what is the tallest mountain on
earth; who was the first person to walk on the moon; what is the currency of japan; how many strings does a
violin have; what does dna stand for; who composed the four seasons; what is the hardest natural substance;
when did the titanic sink; what is the main ingredient of guacamole; how many hearts does an octopus have;
what is the fastest land animal; who developed the theory of relativity; what is the freezing point of water
in kelvin; where is the great barrier reef; how long does it take light from the sun to reach earth; what
gas do plants absorb; who built the first successful airplane; what is the largest ocean; how many days are in
a leap year; what is the speed of sound; which planet is known as the red planet; who is known as the father of
computers; what is the largest desert in the world; what instrument has 88 keys; what is the square root of
144; when did the berlin wall fall; who wrote pride and prejudice; what is the most spoken language in the
world; what organ produces insulin; how many minutes are in a day; which element has the atomic number 1""".split(";")

GERMAN = """Der Zug nach Hamburg hat heute zwanzig Minuten Verspätung.
Meine Schwester arbeitet seit drei Jahren als Ärztin in einem kleinen Krankenhaus.
Die Regierung hat gestern neue Regeln für den Klimaschutz vorgestellt.
Im Sommer fahren wir oft mit dem Fahrrad an den See.
Das Museum ist am Montag geschlossen, aber am Dienstag wieder geöffnet.
Viele Studenten suchen in der Stadt eine bezahlbare Wohnung.
Der Bäcker an der Ecke verkauft das beste Brot im ganzen Viertel.
Nach dem Spiel feierten die Fans bis spät in die Nacht.
Die Firma plant, im nächsten Jahr zweihundert neue Mitarbeiter einzustellen.
Kannst du mir bitte sagen, wie ich zum Bahnhof komme?
Das Wetter soll am Wochenende sonnig und warm werden.
Unsere Lehrerin hat uns eine spannende Geschichte über die Römer erzählt.
Der Bürgermeister eröffnete am Samstag die neue Brücke über den Fluss.
Ich habe vergessen, die Fenster zu schließen, bevor es geregnet hat.
Die Preise für Strom und Gas sind in diesem Winter stark gestiegen.
Wissenschaftler haben eine neue Art von Frosch im Regenwald entdeckt.
Wir treffen uns um acht Uhr vor dem Kino.
Das Konzert war ausverkauft, deshalb haben wir es im Radio gehört.
Der Arzt empfahl ihm, mehr Wasser zu trinken und früher schlafen zu gehen.
Die Bibliothek bietet jeden Mittwoch einen Lesekreis für Kinder an.
Nach langen Verhandlungen einigten sich beide Seiten auf einen Kompromiss.
Mein Großvater erzählt gern von seiner Zeit als Seemann.
Die Polizei bittet die Bevölkerung um Hinweise zu dem Unfall.
In der Küche riecht es nach frischem Kaffee und Zimt.
Das neue Gesetz tritt am ersten Januar in Kraft.
Der Flughafen wurde wegen eines Sturms für mehrere Stunden gesperrt.
Sie lernt Spanisch, weil sie im Herbst nach Madrid ziehen möchte.
Die Mannschaft hat das Finale knapp mit zwei zu eins gewonnen.
Immer mehr Menschen kaufen regionales Gemüse auf dem Wochenmarkt.
Der Roman erzählt die Geschichte einer Familie über drei Generationen.""".splitlines()


def word_problems(rng: random.Random, n: int) -> list[str]:
    out = []
    for _ in range(n):
        t = rng.choice(MATH)
        out.append(t.format(n=rng.choice(NAMES), i=rng.choice(ITEMS), a=rng.randint(2, 9), b=rng.randint(2, 12),
                            c=rng.randint(2, 15), p=rng.choice([20, 50, 100, 200]), q=rng.randint(3, 30) * 10,
                            h=rng.randint(6, 11), s=rng.randint(6, 16) * 10, w=rng.randint(10, 40)))
    return out


def prompts(n: int, seed: int) -> list[str]:
    rng = random.Random(seed)
    topics = [t.strip() for t in TOPICS if t.strip()]
    crossed = [tm.format(t=t) for t in topics for tm in TEMPLATES]
    rng.shuffle(crossed)
    code = [f"Write a {lang} function that {task.strip()}." for task in CODE_TASKS for lang in LANGS]
    rng.shuffle(code)
    factoid = [q.strip().replace("\n", " ") + "?" for q in FACTOID]
    german = [f"Translate German to English: {s.strip()}" for s in GERMAN]
    n_math, n_code = n // 8, n // 16
    rest = n - n_math - n_code - len(factoid) - len(german)
    out = crossed[: max(0, rest)] + word_problems(rng, n_math) + code[:n_code] + factoid + german
    out = [" ".join(p.split()) for p in out]
    rng.shuffle(out)
    return list(dict.fromkeys(out))  # distinct, order kept


PASSAGE_TEMPLATES = [
    "Summarize the following text in three sentences.\n\n{p}",
    "Write a one-paragraph summary of this article:\n\n{p}",
    "Read the passage and list its three most important points.\n\n{p}",
    "Here is a text:\n\n{p}\n\nRewrite it in simpler words for a ten-year-old.",
    "{p}\n\nWhat is the main idea of the text above? Answer in one or two sentences.",
    "Give the following text a title, then summarize it in one sentence.\n\n{p}",
]
RAG_TEMPLATE = "Answer the question using the documents below.\n\nDocument 1: {a}\n\nDocument 2: {b}\n\nQuestion: {q}"


def passages(answers_path: str, tokenizer_dir: str, min_tokens: int, seed: int) -> list[str]:
    """Requests over the target's own answers (>= min_tokens answer tokens, cut after the last full
    sentence): one passage template each, plus a two-document question per pair of passages."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tokenizer_dir)
    rng = random.Random(seed)
    docs, seen = [], set()
    for line in open(answers_path):
        r = json.loads(line)
        p, ids = r["prompt_len"], r["ids"]
        if len(ids) - p < min_tokens or tuple(ids[:p]) in seen:
            continue
        seen.add(tuple(ids[:p]))
        question = tok.decode(ids[:p], skip_special_tokens=True).split("user", 1)[-1].split("assistant")[0]
        text = tok.decode(ids[p:], skip_special_tokens=True).strip()
        end = max(text.rfind(". "), text.rfind(".\n"), text.rfind("."))
        text = text[: end + 1] if end > len(text) // 2 else text
        docs.append((" ".join(question.split()), re.sub(r"\n{3,}", "\n\n", text)))
    out = [PASSAGE_TEMPLATES[i % len(PASSAGE_TEMPLATES)].format(p=d) for i, (_, d) in enumerate(docs)]
    order = list(range(len(docs)))
    rng.shuffle(order)
    for i, j in zip(order[0::2], order[1::2]):
        a, b = (i, j) if rng.random() < 0.5 else (j, i)  # the answer sits in either document
        out.append(RAG_TEMPLATE.format(a=docs[a][1], b=docs[b][1], q=docs[i][0]))
    rng.shuffle(out)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--n", type=int, default=1900)
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--passages", metavar="ANSWERS", help="answers file (JSONL): requests over its answers")
    ap.add_argument("--tokenizer", metavar="DIR", help="the target's tokenizer, to decode the answers")
    ap.add_argument("--min-tokens", type=int, default=120, help="shortest answer used as a passage")
    args = ap.parse_args()
    if args.passages:
        if not args.tokenizer:
            ap.error("--passages needs --tokenizer")
        for p in passages(args.passages, args.tokenizer, args.min_tokens, args.seed):
            print(json.dumps({"prompt": p}))
        return
    for p in prompts(args.n, args.seed):
        print(p)


if __name__ == "__main__":
    main()
