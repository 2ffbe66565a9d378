"""The embedded dialogue data: reproducible, split-disjoint, and summaries that follow from the plan."""

import random
import re

import pytest

from shardtune.data.synthetic import (
    ACTIVITIES,
    DAYS,
    NAMES,
    PROMPT_PREFIX,
    PROMPT_SUFFIX,
    corpus_for_tokenizer,
    generate_dialogues,
    generate_plans,
    render_dialogue,
    summarize,
)


def test_same_seed_same_rows_and_different_seed_different_rows():
    assert generate_dialogues(50, seed=7) == generate_dialogues(50, seed=7)
    assert generate_dialogues(50, seed=7) != generate_dialogues(50, seed=8)


def test_rows_have_the_samsum_fields_and_unique_ids():
    rows = generate_dialogues(100, seed=1, split="validation")
    assert all(set(row) == {"id", "dialogue", "summary"} for row in rows)
    assert len({row["id"] for row in rows}) == 100


def test_splits_share_no_dialogue_even_with_the_same_seed():
    train = {row["dialogue"] for row in generate_dialogues(2000, seed=3, split="train")}
    validation = {row["dialogue"] for row in generate_dialogues(200, seed=3, split="validation")}
    test = {row["dialogue"] for row in generate_dialogues(200, seed=3, split="test")}
    assert len(train) == 2000 and len(validation) == 200 and len(test) == 200
    assert not train & validation and not train & test and not validation & test


def test_unknown_split_is_refused():
    with pytest.raises(ValueError, match="split 'dev'"):
        generate_dialogues(1, seed=0, split="dev")


def test_dialogue_lines_are_name_colon_text_from_two_to_four_participants():
    for plan in generate_plans(300, seed=5):
        speakers = {line.split(": ", 1)[0] for line in render_dialogue(plan).split("\n")}
        assert 2 <= len(plan.participants) <= 4
        assert speakers <= set(plan.participants) <= set(NAMES)
        assert plan.place in ACTIVITIES[plan.activity] and plan.day in DAYS


def test_summary_states_who_what_where_when_and_the_twists():
    plans = generate_plans(500, seed=11)
    for plan in plans:
        summary, dialogue = summarize(plan), render_dialogue(plan)
        first, _, rest = summary.partition(". ")
        assert all(name in first for name in plan.attendees)
        assert not any(name in first for name in plan.absent)
        assert f"will {plan.activity} at {plan.place} on {plan.day} at {plan.time}" in first
        assert all(name in rest for name in plan.absent) and ("can't come" in rest) == bool(plan.absent)
        assert (f"{plan.bringer} will bring {plan.item}" in rest) == bool(plan.bringer)
        for fact in (plan.place, plan.day, plan.activity):
            assert fact in dialogue
    assert any(p.absent for p in plans) and any(p.bringer for p in plans)
    assert any(p.time != p.first_time for p in plans)


def test_a_moved_time_appears_in_the_dialogue_after_the_first_one():
    moved = [p for p in generate_plans(200, seed=2) if p.time != p.first_time]
    assert moved
    for plan in moved:
        dialogue = re.sub(r"(\d)(am|pm)\b", r"\1 \2", render_dialogue(plan))  # people may type "7pm"
        first_said = re.search(rf"\b{re.escape(plan.first_time)}", dialogue).start()
        last_said = [m.start() for m in re.finditer(rf"\b{re.escape(plan.time)}", dialogue)][-1]
        assert last_said > first_said


def test_summaries_are_one_or_two_sentences():
    for row in generate_dialogues(300, seed=4):
        assert row["summary"].endswith(".") and row["summary"].count(". ") <= 1


def test_data_is_varied_enough_not_to_be_memorised():
    rows = generate_dialogues(4000, seed=1234)
    assert len({row["summary"] for row in rows}) > 3900
    assert len({line.split(": ", 1)[1] for row in rows for line in row["dialogue"].split("\n")}) > 1000


def test_generation_does_not_touch_the_global_random_state():
    random.seed(0)
    expected = random.random()
    random.seed(0)
    generate_dialogues(10, seed=0)
    assert random.random() == expected


def test_tokenizer_corpus_contains_the_prompt_strings_and_general_text():
    text = "\n".join(corpus_for_tokenizer(seed=0, num_dialogues=10))
    assert PROMPT_PREFIX in text and PROMPT_SUFFIX in text
    assert "### Instruction:" in text and all(d in text for d in "0123456789")


def test_chatter_spreads_lengths_like_samsum_and_keeps_the_plan_and_summary():
    plans = generate_plans(400, seed=9)
    plain = [render_dialogue(plan) for plan in plans]
    chatty = [render_dialogue(plan, chatter=True) for plan in plans]
    turns = [dialogue.count("\n") + 1 for dialogue in chatty]
    assert max(turns) <= 30 and min(turns) >= 3
    assert max(turns) >= 25 and sorted(turns)[len(turns) // 2] < 16  # a long tail, most dialogues short
    changed = sum(a != b for a, b in zip(plain, chatty))
    assert 0.4 * len(plans) < changed < 0.8 * len(plans)
    for plan, a, b in zip(plans, plain, chatty):
        # the plan's own turns are all there, in order; chatter names no day, time, place or activity
        b_lines = iter(b.split("\n"))
        assert all(line in b_lines for line in a.split("\n"))  # a subsequence: consumed in order
        extra = [line for line in b_lines if line not in a.split("\n")]
        assert not any(word in line for line in extra for word in (*DAYS, plan.place, plan.activity, " pm", " am"))
        assert {line.split(": ", 1)[0] for line in extra} <= set(plan.participants)
    rows = generate_dialogues(50, seed=2, chatter=True)
    assert [r["summary"] for r in rows] == [r["summary"] for r in generate_dialogues(50, seed=2)]
