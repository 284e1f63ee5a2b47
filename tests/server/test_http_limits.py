"""The HTTP server's pure limits: which connections give way to new ones, and how big a response may be."""

from __future__ import annotations

import pytest

from fdcore.server import budget
from fdcore.server.http import ConnectionTable, Entry
from fdcore.server.schemas import BadRequest


def _fill(table: ConnectionTable, peer: str, count: int, start: float = 0.0, waiting: bool = True) -> list[Entry]:
    entries = []
    for i in range(count):
        entry = Entry(peer, start + i if waiting else None)
        assert table.admit(entry) == []
        entries.append(entry)
    return entries


def test_a_peer_at_its_cap_makes_room_by_closing_its_own_oldest_waiting_connection():
    table = ConnectionTable(max_connections=100, max_per_peer=3)
    mine = _fill(table, "10.0.0.1", 3)
    other = _fill(table, "10.0.0.2", 2)
    new = Entry("10.0.0.1", 10.0)
    assert table.admit(new) == [mine[0]]
    assert table.count == 5 and new in table.by_peer["10.0.0.1"] and other == table.by_peer["10.0.0.2"]


def test_connections_serving_a_request_are_never_closed_for_a_new_one():
    table = ConnectionTable(max_connections=100, max_per_peer=2)
    _fill(table, "a", 2, waiting=False)
    assert table.admit(Entry("a", 5.0)) is None  # refused: both of a's connections serve requests
    assert table.count == 2
    assert table.admit(Entry("b", 5.0)) == []  # another peer is not concerned


def test_a_full_table_closes_the_oldest_waiting_connection_of_the_peer_with_the_most():
    table = ConnectionTable(max_connections=6, max_per_peer=10)
    big = _fill(table, "attacker", 4, start=5.0)
    small = _fill(table, "user", 2, start=0.0)  # older, but their peer holds fewer
    new = Entry("newcomer", 20.0)
    assert table.admit(new) == [big[0]]
    assert table.count == 6 and small == table.by_peer["user"]


def test_a_full_table_of_requests_in_hand_refuses_and_removal_frees_room():
    table = ConnectionTable(max_connections=3, max_per_peer=3)
    serving = _fill(table, "a", 3, waiting=False)
    assert table.admit(Entry("b", 1.0)) is None
    table.remove(serving[1])
    table.remove(serving[1])  # idempotent
    assert table.count == 2
    assert table.admit(Entry("b", 1.0)) == []


def test_slow_sockets_of_one_peer_never_keep_another_peers_request_out():
    """The attack as a model: a peer opens connections forever and never sends a request; a user
    connects now and then and sends its request at once. Every user connection is admitted."""
    table = ConnectionTable(max_connections=50, max_per_peer=40)
    clock = 0.0
    for round_ in range(200):
        for _ in range(25):
            clock += 1
            table.admit(Entry("attacker", clock))
        clock += 1
        user = Entry("user", clock)
        assert table.admit(user) is not None, round_
        user.waiting_since = None  # its head arrived: it serves
        table.remove(user)  # answered
    assert table.count <= 50 and len(table.by_peer["attacker"]) <= 40


def test_a_response_budget_counts_tokens_logprobs_echo_and_prompt_scores():
    assert budget.Ask(16).entries() == 16
    assert budget.Ask(16, top=20).entries() == 16 * 21
    assert (
        budget.Ask(16, top=20, prompt_tokens=100, echo_top=20, scored_top=5).entries() == 16 * 21 + 100 * 21 + 100 * 6
    )
    # the attack of issue 43: 64 choices, 2,040 prompt tokens echoed and scored with 20 logprobs each
    heavy = [budget.Ask(16, 20, 2040, 20, 20)] * 64
    with pytest.raises(BadRequest, match="5,505,024 tokens and logprobs") as refused:
        budget.check(heavy, 200_000, "n, max_tokens, logprobs, echo, prompt_logprobs")
    assert refused.value.param == "n" and refused.value.status == 400
    budget.check([budget.Ask(1000, 20)] * 8, 200_000, "n, max_tokens, logprobs")  # 168,000: allowed


def test_a_text_prompts_bound_is_never_below_its_token_count():
    from tokenizers import Tokenizer

    from fdcore.checkpoint import tiny

    tokenizer = Tokenizer.from_file(tiny.TOKENIZER)
    texts = ["", "a", "Grüße aus München", "日本語のテキスト", "x" * 5000, "\u0000\uffff" * 10, "<|im_start|>" * 7]
    for text in texts:
        assert len(tokenizer.encode(text).ids) <= budget.text_tokens_bound(text, 1 << 20)
    assert budget.text_tokens_bound("x" * 5000, 2048) == 2048
