"""Embedded synthetic dialogue-summarisation data in the SAMSum format; no downloads, all text written here.

Each example is a messenger chat between 2-4 people planning an event. The summary is a fixed function of a
structured ``Plan`` (who comes, what, when, where, plus twists: someone declines, the time moves, someone
brings something), so a small model can learn the mapping while the phrasing varies too much to memorise.

Splits never share a plan: a plan belongs to the split its content hash assigns it to, whatever the seed.
"""

from __future__ import annotations

import hashlib
import random
from dataclasses import dataclass
from typing import Iterator

SPLITS = ("train", "validation", "test")
PROMPT_PREFIX = "Summarize this dialog:\n"
PROMPT_SUFFIX = "\n---\nSummary:\n"

NAMES = (
    "Anna",
    "Tom",
    "Kate",
    "Ben",
    "Lucy",
    "Mark",
    "Emma",
    "Jack",
    "Sophie",
    "Dan",
    "Olivia",
    "Sam",
    "Mia",
    "Leo",
    "Grace",
    "Adam",
    "Chloe",
    "Ryan",
    "Julia",
    "Nick",
    "Laura",
    "Paul",
    "Hannah",
    "Oscar",
    "Ella",
    "Victor",
    "Nora",
    "Peter",
    "Zoe",
    "Igor",
    "Alice",
    "Henry",
    "Maya",
    "Felix",
    "Rosa",
    "Simon",
    "Ivy",
    "Karl",
    "Lena",
    "Omar",
)

# activity (as said after "will") -> places where it happens (as said after "at")
ACTIVITIES = {
    "go to the cinema": ("the Odeon", "Cinema City", "the Roxy"),
    "have dinner": ("Luigi's", "the Golden Dragon", "Casa Rosa"),
    "play tennis": ("the city courts", "Greenfield Club", "the park courts"),
    "go bowling": ("Strike Zone", "Lucky Lanes", "the bowling alley on Main Street"),
    "go hiking": ("Pine Ridge", "the Blue Lake trail", "Eagle Hill"),
    "have a picnic": ("Riverside Park", "the botanical garden", "Willow Meadow"),
    "go swimming": ("the city pool", "Aqua Park", "Sunny Beach"),
    "play football": ("the school field", "Victoria Park", "the sports centre"),
    "watch the match": ("the Crown", "Murphy's", "the sports bar"),
    "have coffee": ("Bean There", "the Corner Cafe", "Cafe Aroma"),
    "go to a concert": ("the Arena", "the Jazz Cellar", "City Hall"),
    "go climbing": ("the climbing gym", "Boulder Box", "Rock Spot"),
    "play board games": ("the Dice Tower", "the library cafe", "Meeple House"),
    "visit the new exhibition": ("the National Museum", "the Science Museum", "the Modern Art Gallery"),
    "go ice skating": ("the ice rink", "Frost Arena", "the Winter Garden"),
    "go cycling": ("the river path", "Oak Forest", "the old railway trail"),
    "have a barbecue": ("the lake shore", "the community garden", "Sunset Point"),
    "sing karaoke": ("Echo Lounge", "the Karaoke Box", "Star Bar"),
    "play basketball": ("the outdoor court", "the gym on Park Road", "Central Court"),
    "go shopping": ("the mall", "Westfield Centre", "the old market"),
    "do yoga": ("Zen Studio", "the park by the river", "Lotus Yoga"),
    "go to the theatre": ("the Globe", "the Playhouse", "the Royal Theatre"),
    "have lunch": ("the Green Bowl", "Noodle House", "Pasta Point"),
}
DAYS = ("Monday", "Tuesday", "Wednesday", "Thursday", "Friday", "Saturday", "Sunday")
HOURS = tuple(range(9, 22))  # 9 am .. 9 pm, each on the hour or at half past
ITEMS = (
    "snacks",
    "drinks",
    "a blanket",
    "the tickets",
    "a ball",
    "some cake",
    "sandwiches",
    "a speaker",
    "fruit",
    "water",
)

GREETINGS = (
    "Hi {who}!",
    "Hey {who}",
    "Hello {who}!",
    "Hey {who}, got a minute?",
    "Morning {who}!",
    "Hi {who}, quick question",
)
SMALL_TALK_ASK = ("Hi! How are you?", "Hey, what's up?", "Hello! All good?", "Hi, long time no see!")
SMALL_TALK_REPLY = (
    "All good, thanks!",
    "Pretty good, busy week though.",
    "Fine, finally some free time.",
    "Great, thanks for asking.",
)
PROPOSALS = (
    "Do you want to {act} on {day}?",
    "Anyone up for a plan? I'd like to {act} on {day}.",
    "Shall we {act} on {day}?",
    "How about we {act} on {day}?",
    "Would you like to {act} on {day}?",
)
OPEN_QUESTIONS = ("Is anyone free on {day}?", "What are you doing on {day}?", "Any plans for {day}?")
WHAT_FOR = ("Why, what's the plan?", "Maybe, what do you have in mind?", "Not sure yet, why?")
OPEN_ANSWERS = ("I thought we could {act}.", "I'd like to {act}.", "Let's {act}!")
PLACE_TIME = (
    "How about {place} at {time}?",
    "I was thinking {place}, {time}.",
    "We could meet at {place} at {time}.",
    "Let's say {place} at {time}.",
)
ASK_WHERE = ("Where and when?", "Sounds fun! Where?", "Where exactly?", "Nice idea, where do we meet?")
ANSWER_WHERE = ("At {place}. Say {time}?", "At {place}, around {time}.", "I'd say {place} at {time}.")
YES = (
    "I'm in!",
    "Count me in.",
    "Sounds great, I'll come.",
    "Sure, why not!",
    "Yes, I'd love to!",
    "Works for me.",
    "Great idea, see you there.",
)
NO = (
    "Sorry, I can't make it, {reason}.",
    "I'd love to but {reason}.",
    "Not this time, {reason}.",
    "Oh no, {reason}. Have fun without me!",
)
REASONS = (
    "I have to work late",
    "my parents are visiting",
    "I have an exam the next morning",
    "I'm looking after my niece",
    "I'm still sick",
    "I'm away that weekend",
    "I promised to help a friend move",
)
DECLINE_REPLIES = ("No worries, next time!", "Too bad!", "Oh, that's a pity.", "Okay, maybe next time.")
CHANGE_LATER = (
    "Can we make it {time} instead? I finish work late.",
    "Could we do {time}? I'll be busy before that.",
    "Is {time} okay too? I can't be there earlier.",
)
CHANGE_EARLIER = (
    "Can we make it {time} instead? I need to be home early.",
    "Could we do {time}? I have something later that evening.",
    "What about {time}? Earlier is better for me.",
)
CHANGE_ACCEPT = ("Sure, {time} then.", "Fine by me, {time} it is.", "Okay, let's do {time}.")
BRING = ("I'll bring {item}.", "I can bring {item}.", "Don't worry, I'll bring {item}.")
BRING_REPLY = ("Perfect!", "Great, thanks!", "Lovely.", "Good idea.")
CLOSINGS = ("See you on {day}!", "Great, see you there!", "Can't wait!", "Perfect, see you!", "Looking forward to it.")

# Off-topic exchanges (an opener and its possible replies) that --synthetic_dialogues.chatter mixes into about
# half of the dialogues. They name no person, day, time, place or activity, so the summary does not change.
CHATTER = (
    (
        "Did you watch the game last night?",
        ("Yes, what a finish!", "No, I missed it. Who won?", "Only the second half, I fell asleep."),
    ),
    (
        "How's the new job going?",
        ("Busy, but I like the team.", "Tiring, there is so much to learn.", "Great so far, thanks for asking!"),
    ),
    (
        "Have you finished the book I lent you?",
        ("Almost, two chapters left.", "Not yet, sorry!", "Yes, I loved the ending."),
    ),
    ("My sister just got a puppy!", ("Aww, send pictures!", "What breed is it?", "So cute, lucky her.")),
    (
        "The weather has been terrible this week.",
        ("I know, rain every single day.", "Tell me about it.", "At least it's not cold."),
    ),
    (
        "I started learning Spanish.",
        ("Cool, how is it going?", "Good luck with that!", "I tried once, the verbs killed me."),
    ),
    (
        "I'm so tired, I worked the whole weekend.",
        ("You need a break.", "Poor you, get some sleep.", "Same here, it never ends."),
    ),
    (
        "Have you seen the new series everyone is talking about?",
        ("Yes, I watched it in two nights!", "Not yet, no spoilers please.", "I didn't like the first episode."),
    ),
    ("My phone died again.", ("Time for a new one.", "Did you try a new battery?", "That's why you never answer!")),
    ("Guess what, I passed my driving test!", ("Congrats!!", "Finally, well done!", "Amazing, you deserve it.")),
    (
        "I need a new laptop, any ideas?",
        ("What's your budget?", "Mine is great, I'll send you the link.", "Wait for the sales next month."),
    ),
    ("The traffic this morning was crazy.", ("I took the bike, much faster.", "Roadworks again?", "I was late too.")),
    ("I cooked pasta from scratch yesterday.", ("Wow, chef!", "Was it good?", "Teach me one day.")),
    ("Our neighbours are renovating again.", ("Oh no, the drilling?", "Noise every morning?", "Buy earplugs.")),
    ("I can't find my keys anywhere.", ("Check your jacket.", "Again? haha", "Did you leave them at work?")),
    ("My parents want to sell the house.", ("Wow, big change.", "How do you feel about it?", "Where would they move?")),
)
REACTIONS = (
    "haha",
    "lol",
    "Really?",
    "No way!",
    "Nice!",
    "True.",
    "Oh no.",
    "Same here.",
    "Exactly!",
    ":)",
    "Wow.",
    "I know, right?",
    "Fair enough.",
    "Ha, typical.",
)
MAX_TURNS = 30  # SAMSum's dialogues have 3 to 30 utterances

# Ordinary English the dialogues do not contain, so that other data (alpaca-style instructions) still
# tokenises into sensible pieces rather than single bytes.
GENERAL_TEXT = (
    "Below is an instruction that describes a task. Write a response that appropriately completes the request.",
    "### Instruction:\n### Input:\n### Response:\n",
    "Explain the difference between a list and a tuple in Python, and give an example of each.",
    "The quick brown fox jumps over the lazy dog. What is the capital of France? Paris is the capital.",
    "Write a short story about a robot who learns to paint. Translate the following sentence into German.",
    "Give three tips for staying healthy: eat well, sleep enough, and exercise every day.",
    "Classify the following numbers as even or odd: 0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 42, 100, 2024, 3.14.",
    "Summarize the article in one paragraph. Describe the main idea, the results, and the conclusion.",
    "People often ask why the sky is blue; the answer involves light, air and the way colours scatter.",
    "Generate a list of five questions you could ask in a job interview about the company and the team.",
    "Calculate the total: 12 + 7 = 19; 3 * 4 = 12; 10 / 2 = 5; 2^8 = 256; 50% of 80 is 40.",
    "Punctuation: . , ; : ! ? ' \" ( ) [ ] { } - _ / \\ @ # $ % & * + = < > | ~ ` ...",
    "Because of the weather, the government, the school and the university changed their important plans.",
    "first second third world country city water money business history science music family health",
    "should would could might must will shall can may need want know think make take give find tell",
    "about after again against because before between during through under until while where which",
)


@dataclass(frozen=True)
class Plan:
    """The facts of one dialogue; the summary is computed from these alone."""

    participants: tuple[str, ...]  # participants[0] organises
    activity: str
    place: str
    day: str
    time: str  # the final time
    first_time: str  # the time first proposed (equal to time unless it moved)
    absent: tuple[str, ...]
    bringer: str
    item: str
    phrasing_seed: int

    @property
    def attendees(self) -> tuple[str, ...]:
        return tuple(p for p in self.participants if p not in self.absent)

    def key(self) -> str:
        """Everything but the phrasing: two plans with the same key are the same example for split purposes."""
        return "|".join(
            (
                ",".join(self.participants),
                self.activity,
                self.place,
                self.day,
                self.time,
                self.first_time,
                ",".join(self.absent),
                self.bringer,
                self.item,
            )
        )


def format_time(hour: int, minute: int) -> str:
    suffix = "am" if hour < 12 else "pm"
    shown = hour if hour <= 12 else hour - 12
    return f"{shown} {suffix}" if minute == 0 else f"{shown}:{minute:02d} {suffix}"


def join_names(names: tuple[str, ...] | list[str]) -> str:
    return names[0] if len(names) == 1 else ", ".join(names[:-1]) + " and " + names[-1]


def _random_slot(rng: random.Random) -> tuple[int, int]:
    return rng.choice(HOURS), rng.choice((0, 30))


def _moved_time(rng: random.Random, hour: int, minute: int) -> tuple[int, int]:
    new_hour = min(max(hour + rng.choice((-2, -1, 1, 2)), HOURS[0]), HOURS[-1])
    if new_hour == hour:
        new_hour = hour - 1 if hour == HOURS[-1] else hour + 1
    return new_hour, minute


def random_plan(rng: random.Random) -> Plan:
    participants = tuple(rng.sample(NAMES, rng.choice((2, 3, 3, 4))))
    activity = rng.choice(sorted(ACTIVITIES))
    hour, minute = _random_slot(rng)
    moved = rng.random() < 0.25
    final = _moved_time(rng, hour, minute) if moved else (hour, minute)
    others = participants[1:]
    num_absent = rng.randint(1, len(others) - 1) if len(others) > 1 and rng.random() < 0.4 else 0
    declined = set(rng.sample(others, num_absent))
    absent = tuple(p for p in participants if p in declined)
    coming = [p for p in participants if p not in absent]
    bringing = rng.random() < 0.3
    return Plan(
        participants=participants,
        activity=activity,
        place=rng.choice(ACTIVITIES[activity]),
        day=rng.choice(DAYS),
        time=format_time(*final),
        first_time=format_time(hour, minute),
        absent=absent,
        bringer=rng.choice(coming) if bringing else "",
        item=rng.choice(ITEMS) if bringing else "",
        phrasing_seed=rng.getrandbits(32),
    )


def summarize(plan: Plan) -> str:
    first = f"{join_names(plan.attendees)} will {plan.activity} at {plan.place} on {plan.day} at {plan.time}."
    extras = []
    if plan.bringer:
        extras.append(f"{plan.bringer} will bring {plan.item}")
    if plan.absent:
        extras.append(f"{join_names(plan.absent)} can't come")
    return first if not extras else f"{first} {' and '.join(extras)}."


def _spoken_time(rng: random.Random, time: str) -> str:
    """People type "7 pm" or "7pm"; the summary always says "7 pm"."""
    return time.replace(" ", "") if rng.random() < 0.3 else time


def _opening(plan: Plan, rng: random.Random) -> list[tuple[str, str]]:
    organiser, others = plan.participants[0], plan.participants[1:]
    who = others[0] if len(others) == 1 else rng.choice(("guys", "everyone", "all"))
    turns = [(organiser, rng.choice(GREETINGS).format(who=who))]
    if rng.random() < 0.5:
        turns.append((rng.choice(others), rng.choice(SMALL_TALK_ASK)))
        turns.append((organiser, rng.choice(SMALL_TALK_REPLY)))
    return turns


def _proposal(plan: Plan, rng: random.Random) -> list[tuple[str, str]]:
    organiser, others = plan.participants[0], plan.participants[1:]
    place_time = {"place": plan.place, "time": _spoken_time(rng, plan.first_time)}
    if rng.random() < 0.3:
        turns = [
            (organiser, rng.choice(OPEN_QUESTIONS).format(day=plan.day)),
            (rng.choice(others), rng.choice(WHAT_FOR)),
            (organiser, rng.choice(OPEN_ANSWERS).format(act=plan.activity)),
        ]
    else:
        turns = [(organiser, rng.choice(PROPOSALS).format(act=plan.activity, day=plan.day))]
    if rng.random() < 0.5:
        turns.append((organiser, rng.choice(PLACE_TIME).format(**place_time)))
    else:
        turns.append((rng.choice(others), rng.choice(ASK_WHERE)))
        turns.append((organiser, rng.choice(ANSWER_WHERE).format(**place_time)))
    return turns


def _answers(plan: Plan, rng: random.Random) -> list[tuple[str, str]]:
    organiser, turns = plan.participants[0], []
    for person in rng.sample(plan.participants[1:], len(plan.participants) - 1):
        if person in plan.absent:
            turns.append((person, rng.choice(NO).format(reason=rng.choice(REASONS))))
            if rng.random() < 0.6:
                turns.append((organiser, rng.choice(DECLINE_REPLIES)))
        else:
            turns.append((person, rng.choice(YES)))
    return turns


def _twists(plan: Plan, rng: random.Random) -> list[tuple[str, str]]:
    organiser, turns = plan.participants[0], []
    guests = [p for p in plan.attendees if p != organiser]
    if plan.time != plan.first_time:
        later = _hour_of(plan.time) > _hour_of(plan.first_time)
        spoken = _spoken_time(rng, plan.time)
        turns.append((rng.choice(guests), rng.choice(CHANGE_LATER if later else CHANGE_EARLIER).format(time=spoken)))
        turns.append((organiser, rng.choice(CHANGE_ACCEPT).format(time=spoken)))
    if plan.bringer:
        turns.append((plan.bringer, rng.choice(BRING).format(item=plan.item)))
        replier = organiser if plan.bringer != organiser else rng.choice(guests)
        turns.append((replier, rng.choice(BRING_REPLY)))
    return turns


def _hour_of(time: str) -> float:
    clock, suffix = time.split(" ")
    hour, _, minute = clock.partition(":")
    return int(hour) % 12 + (12 if suffix == "pm" else 0) + (int(minute or 0) / 60)


def _chatter(plan: Plan, rng: random.Random, budget: int) -> list[tuple[str, str]]:
    """Off-topic turns: none for 40% of dialogues, else a count with a long tail (mean ~9, at most ``budget``)."""
    if rng.random() < 0.4 or budget < 2:
        return []
    wanted = min(budget, 2 + int(rng.expovariate(1 / 7)))
    turns: list[tuple[str, str]] = []
    for opener, replies in rng.sample(CHATTER, len(CHATTER)):
        if len(turns) + 2 > wanted:
            break
        speaker = rng.choice(plan.participants)
        listener = rng.choice([p for p in plan.participants if p != speaker])
        turns += [(speaker, opener), (listener, rng.choice(replies))]
        while len(turns) < wanted and rng.random() < 0.35:
            turns.append((rng.choice(plan.participants), rng.choice(REACTIONS)))
    return turns


def render_dialogue(plan: Plan, chatter: bool = False) -> str:
    """The plan as a chat. With ``chatter``, about half of the dialogues also talk about other things (before
    the plan or after it), which spreads their lengths like SAMSum's; the summary stays the same."""
    rng = random.Random(plan.phrasing_seed)
    opening = _opening(plan, rng)
    turns = _proposal(plan, rng) + _answers(plan, rng) + _twists(plan, rng)
    turns.append((rng.choice(plan.attendees), rng.choice(CLOSINGS).format(day=plan.day)))
    if chatter:  # its own random stream: the plan's own turns are the same with and without chatter
        chat_rng = random.Random(f"chatter:{plan.phrasing_seed}")
        extra = _chatter(plan, chat_rng, MAX_TURNS - len(opening) - len(turns))
        turns = turns + extra if chat_rng.random() < 0.5 else extra + turns
    return "\n".join(f"{name}: {text}" for name, text in opening + turns)


def split_of(plan: Plan) -> str:
    """The one split a plan may appear in: 1/20 validation, 1/20 test, the rest train."""
    bucket = int.from_bytes(hashlib.sha256(plan.key().encode()).digest()[:4], "big") % 20
    return "validation" if bucket == 0 else "test" if bucket == 1 else "train"


def generate_plans(num_examples: int, seed: int, split: str = "train") -> list[Plan]:
    """``num_examples`` distinct plans of ``split``, reproducible from (seed, split)."""
    if split not in SPLITS:
        raise ValueError(f"split {split!r} is not one of {', '.join(SPLITS)}")
    rng = random.Random(f"shardtune-synthetic:{seed}:{split}")
    plans: dict[str, Plan] = {}
    while len(plans) < num_examples:
        plan = random_plan(rng)
        if split_of(plan) == split:
            plans.setdefault(plan.key(), plan)
    return list(plans.values())


def generate_dialogues(num_examples: int, seed: int, split: str = "train", chatter: bool = False) -> list[dict]:
    """SAMSum-style rows ``{"id", "dialogue", "summary"}``; splits never share a plan (hence a dialogue)."""
    return [
        {"id": f"{split}-{seed}-{i:06d}", "dialogue": render_dialogue(plan, chatter), "summary": summarize(plan)}
        for i, plan in enumerate(generate_plans(num_examples, seed, split))
    ]


def corpus_for_tokenizer(seed: int, num_dialogues: int = 2000) -> Iterator[str]:
    """Text for training a tokenizer: prompts around dialogues and summaries, every word list, general English."""
    for row in generate_dialogues(num_dialogues, seed, "train"):
        yield PROMPT_PREFIX + row["dialogue"] + PROMPT_SUFFIX + row["summary"]
    for place_list in ACTIVITIES.values():
        yield " ".join(place_list)
    yield " ".join(NAMES + DAYS + ITEMS + tuple(ACTIVITIES))
    yield " ".join(format_time(h, m) for h in HOURS for m in (0, 30))
    yield from GENERAL_TEXT
