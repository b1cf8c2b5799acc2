"""A seeded synthetic world for search-agent QA: entities, relations, a corpus, seven question sets.

The policy knows nothing of this world: names are made of random syllables, so every answer
has to be found by searching the corpus. Relations: person born in a city in a birth year;
city located in a country; organization founded by a person, headquartered in a city.

Eval splits mirror Table 2's datasets (what each tests, not their text):

============  ==========================================================  ============
split         question                                                    paper analog
============  ==========================================================  ============
nq            single hop, popular people (birthplace)                     NQ
triviaqa      single hop, popular people, paraphrased questions           TriviaQA
popqa         single hop, long-tail people and organizations              PopQA
hotpotqa      two-hop bridge: person -> city -> country                   HotpotQA
2wiki         comparison of two people's birth years                      2WikiMultiHopQA
musique       three hops: organization -> founder -> city -> country      MuSiQue
bamboogle     two hops: organization -> headquarters -> country, on       Bamboogle
              organizations that no training question mentions
============  ==========================================================  ============

Training questions come from the nq and hotpotqa analogues, on people disjoint from theirs. With
``demo_frac`` > 0 the training people are split once more: the cold start's demonstrations ask about
one part ("demo"), RL's prompts about the other ("train"), so an RL reward can only be earned by
reading the passages, never by recalling a fact the demonstrations taught.

A fixed world is learned by a policy that trains on it: RL's reward then mixes reading with recall of
the world's facts. ``task.world=episode`` (:func:`episode_world`, :func:`episode_question`) asks every
question in a small world of its own, drawn from the question's name (task seed, split, index): new
people, places and organizations, new facts, and a corpus of that world's passages and distractors.
Nothing learned about one world answers another's question, so the only way to a reward is to search
and read. The seven splits keep their shapes.
"""

from __future__ import annotations

import random
from dataclasses import dataclass, field

SYL = ["ka", "lo", "mi", "ren", "tor", "va", "shi", "dun", "bel", "qui", "ros", "fen", "gal", "mor", "ti", "zan",
       "pol", "ed", "ur", "nix", "sa", "bri", "cor", "hal", "jun", "lek", "mar", "nod", "ost", "per"]


@dataclass
class Person:
    name: str
    city: str
    year: int
    popular: bool


@dataclass
class Org:
    name: str
    founder: str
    city: str
    year: int
    heldout: bool


@dataclass
class World:
    countries: list[str]
    city_country: dict[str, str]
    people: dict[str, Person]
    orgs: dict[str, Org]
    docs: list[tuple[str, str]] = field(default_factory=list)  # (title, text)


def _name(rng: random.Random, used: set[str], parts: int) -> str:
    while True:
        n = " ".join("".join(rng.choice(SYL) for _ in range(rng.randint(2, 3))).capitalize() for _ in range(parts))
        if n not in used:
            used.add(n)
            return n


PERSON_T = ["{p} was born in {c} in {y}.", "Born in {y} in the city of {c}, {p} grew up there.",
            "{p} ({y}) is a native of {c}.", "The birthplace of {p} is {c}; {p} was born in {y}."]
CITY_T = ["{c} is a city in {k}.", "{c} lies in the country of {k}.", "The city of {c} is located in {k}."]
ORG_T = ["{o} was founded by {p} in {y}. Its headquarters are in {c}.",
         "Founded in {y} by {p}, {o} is headquartered in {c}."]
DISTRACT_T = ["Admirers of {p} once met in {c}.", "A street in {c} is named after {p}.",
              "{p} gave a famous speech in {c} in {y}."]


def build_world(seed: int = 0, n_people: int = 400, n_cities: int = 80, n_countries: int = 20, n_orgs: int = 120,
                popular_frac: float = 0.4, heldout_orgs: float = 0.25, distractors: int = 300) -> World:
    rng = random.Random(f"world-{seed}")
    used: set[str] = set()
    countries = [_name(rng, used, 1) for _ in range(n_countries)]
    cities = [_name(rng, used, 1) for _ in range(n_cities)]
    city_country = {c: rng.choice(countries) for c in cities}
    people = {}
    for i in range(n_people):
        n = _name(rng, used, 2)
        people[n] = Person(n, rng.choice(cities), rng.randint(1900, 1999), popular=i < popular_frac * n_people)
    names = list(people)
    orgs = {}
    for i in range(n_orgs):
        n = _name(rng, used, 1) + " " + rng.choice(["Labs", "Institute", "Company", "Foundation", "Works"])
        orgs[n] = Org(n, rng.choice(names), rng.choice(cities), rng.randint(1950, 2020),
                      heldout=i >= (1 - heldout_orgs) * n_orgs)
    w = World(countries, city_country, people, orgs)
    for p in people.values():  # popular people have two documents in different wordings
        for t in rng.sample(PERSON_T, 2 if p.popular else 1):
            w.docs.append((p.name, t.format(p=p.name, c=p.city, y=p.year)))
    for c, k in city_country.items():
        w.docs.append((c, rng.choice(CITY_T).format(c=c, k=k)))
    for o in orgs.values():
        w.docs.append((o.name, rng.choice(ORG_T).format(o=o.name, p=o.founder, y=o.year, c=o.city)))
    for _ in range(distractors):  # mention a person beside a city that is not their birthplace
        p = people[rng.choice(names)]
        c = rng.choice([x for x in cities if x != p.city])
        w.docs.append((p.name, rng.choice(DISTRACT_T).format(p=p.name, c=c, y=rng.randint(1900, 2020))))
    rng.shuffle(w.docs)
    return w


@dataclass
class Question:
    question: str
    answers: list[str]
    split: str
    hops: int
    entities: list[str]


def comparison_question(a: str, b: str) -> str:
    """The ``2wiki`` question (and its cold-start demonstrations'): the answer is whoever was born first."""
    return f"Who was born first, {a} or {b}?"


PARAPHRASES = ["{p} was born in which city?", "What is the birthplace of {p}?", "Which city is {p} from?"]


def birthplace_question(w: World, person: str, template: str = "Where was {p} born?") -> Question:
    return Question(template.format(p=person), [w.people[person].city], "", 1, [person])


def bridge_question(w: World, person: str) -> Question:
    return Question(f"In which country was {person} born?", [w.city_country[w.people[person].city]], "", 2, [person])


def founder_question(w: World, org: str) -> Question:
    return Question(f"Who founded {org}?", [w.orgs[org].founder], "", 1, [org])


def born_first_question(w: World, a: str, b: str) -> Question:
    """Two people of different birth years; the answer is whoever was born first."""
    first = a if w.people[a].year < w.people[b].year else b
    return Question(comparison_question(a, b), [first], "", 2, [a, b])


def founder_country_question(w: World, org: str) -> Question:
    return Question(f"In which country was the founder of {org} born?",
                    [w.city_country[w.people[w.orgs[org].founder].city]], "", 3, [org])


def headquarters_question(w: World, org: str) -> Question:
    return Question(f"In which country is {org} headquartered?", [w.city_country[w.orgs[org].city]], "", 2, [org])


def _people_split(w: World, popular: bool, rng: random.Random) -> tuple[list[str], list[str]]:
    xs = sorted(n for n, p in w.people.items() if p.popular == popular)
    rng.shuffle(xs)
    cut = int(0.7 * len(xs))
    return xs[:cut], xs[cut:]  # (train people, eval people)


def questions(w: World, seed: int = 0, per_split: int = 100, demo_frac: float = 0.0) -> dict[str, list[Question]]:
    """The RL training questions ("train"), the demonstrations' questions ("demo": the same as "train" when
    ``demo_frac`` = 0, else on that share of the training people, disjoint from RL's) and the seven eval
    splits, each a deterministic function of seed."""
    rng = random.Random(f"questions-{seed}")
    pop_train, pop_eval = _people_split(w, True, rng)
    tail_train, tail_eval = _people_split(w, False, rng)
    demo_people: set[str] = set()
    if demo_frac > 0:  # the last share of each group goes to the demonstrations
        demo_people = set(pop_train[round(len(pop_train) * (1 - demo_frac)):]
                          + tail_train[round(len(tail_train) * (1 - demo_frac)):])
    P = w.people
    out: dict[str, list[Question]] = {}
    train = [birthplace_question(w, n) for n in pop_train + tail_train] + \
        [bridge_question(w, n) for n in pop_train + tail_train]
    rng.shuffle(train)  # (before the split: the eval draws below are the same with or without it)
    out["train"] = [q for q in train if q.entities[0] not in demo_people]
    if demo_people:
        out["demo"] = [q for q in train if q.entities[0] in demo_people]
    pick = lambda xs, k: rng.sample(xs, min(k, len(xs)))
    out["nq"] = [birthplace_question(w, n) for n in pick(pop_eval, per_split)]
    out["triviaqa"] = [birthplace_question(w, n, rng.choice(PARAPHRASES)) for n in pick(pop_eval, per_split)]
    public_orgs = sorted(o for o, v in w.orgs.items() if not v.heldout)
    pq = [birthplace_question(w, n) for n in pick(tail_eval, per_split // 2)]
    pq += [founder_question(w, o) for o in pick(public_orgs, per_split - len(pq))]
    out["popqa"] = pq
    out["hotpotqa"] = [bridge_question(w, n) for n in pick(pop_eval + tail_eval, per_split)]
    comp = []
    pool = pop_eval + tail_eval
    while len(comp) < per_split:
        a, b = rng.sample(pool, 2)
        if P[a].year != P[b].year:
            comp.append(born_first_question(w, a, b))
    out["2wiki"] = comp
    out["musique"] = [founder_country_question(w, o) for o in pick(public_orgs, per_split)]
    held = sorted(o for o, v in w.orgs.items() if v.heldout)
    out["bamboogle"] = [headquarters_question(w, o) for o in pick(held, per_split)]
    out.setdefault("demo", out["train"])
    for name, qs in out.items():
        for q in qs:
            q.split = q.split or name
    return out


# ---------------------------------------------------------------------------------------------------------------
# task.world=episode: a world of its own for every question

WORLDS = ("fixed", "episode")  #: ``task.world``: one world per task seed, or a fresh world for every question


def episode_world(key: str, people: int) -> World:
    """The small world of one question: ``people`` people (half of them popular, with two passages), half as
    many cities in three countries, three organizations and as many distractor passages as people. Names and
    facts are drawn from ``key`` alone, so any process rebuilds the same world, and no two questions share
    their facts: nothing learned about one world answers another's question."""
    return build_world(key, n_people=people, n_cities=max(3, people // 2), n_countries=3, n_orgs=3,
                       popular_frac=0.5, heldout_orgs=0.0, distractors=people)


def episode_question(w: World, key: str, split: str) -> Question:
    """The question of the world ``w`` (built from ``key``) for ``split``: the seven eval splits' shapes as in
    :func:`questions`; "train" asks a birthplace or a bridge (country of birth), half each;
    "birthplace" and "bridge" ask one of the two (the cold start's demonstrations).
    Every organization is new to the policy, so ``bamboogle`` keeps its meaning: a question shape training
    never asks, about an organization no training question mentions."""
    rng = random.Random(f"episode-question-{key}")
    people = sorted(w.people)
    popular = [n for n in people if w.people[n].popular]
    tail = [n for n in people if not w.people[n].popular]
    orgs = sorted(w.orgs)
    if split == "train":
        q = (birthplace_question if rng.random() < 0.5 else bridge_question)(w, rng.choice(people))
    elif split == "birthplace":
        q = birthplace_question(w, rng.choice(people))
    elif split in ("hotpotqa", "bridge"):
        q = bridge_question(w, rng.choice(people))
    elif split == "nq":
        q = birthplace_question(w, rng.choice(popular))
    elif split == "triviaqa":
        q = birthplace_question(w, rng.choice(popular), rng.choice(PARAPHRASES))
    elif split == "popqa":
        q = birthplace_question(w, rng.choice(tail)) if rng.random() < 0.5 else founder_question(w, rng.choice(orgs))
    elif split == "2wiki":
        pairs = [(a, b) for i, a in enumerate(people) for b in people[i + 1:] if w.people[a].year != w.people[b].year]
        if not pairs:
            raise ValueError(f"episode world {key!r}: every person was born in the same year; no comparison to ask")
        a, b = rng.choice(pairs)
        q = born_first_question(w, *((a, b) if rng.random() < 0.5 else (b, a)))
    elif split == "musique":
        q = founder_country_question(w, rng.choice(orgs))
    elif split == "bamboogle":
        q = headquarters_question(w, rng.choice(orgs))
    else:
        raise ValueError(f"no question shape for split {split!r}")
    q.split = split
    return q
