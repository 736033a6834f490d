"""The runner's MTP drafting (``vtcore.worker.mtp``) with a stand-in head whose output names its inputs: which
token each row feeds the head, which row a request's draft starts from (its accepted draft tokens counted on
the device), and where the draft chain writes its KV (the request's blocks, nothing past them)."""
from __future__ import annotations

from types import SimpleNamespace

import torch
from torch import nn
from torch.nn import functional as F

from vtcore.layers.attention import AttentionMetadata, get_attention_metadata
from vtcore.worker.drafting import NO_TOKEN, draft_rows
from vtcore.worker.mtp import MTPDrafter
from vtcore.worker.step import Scheduled

BS, H = 4, 64  # block size; the stand-in's hidden size is its vocabulary


class RecordingHead(nn.Module):
    """Outputs one_hot((id + position) % H): the greedy draft after it is ``(id + position) % H``."""

    def __init__(self) -> None:
        super().__init__()
        self.calls: list[dict] = []

    def forward(self, ids: torch.Tensor, positions: torch.Tensor, hidden: torch.Tensor, step: int) -> torch.Tensor:
        md = get_attention_metadata()
        self.calls.append(dict(ids=ids.tolist(), positions=positions.tolist(), slots=md.slot_mapping.tolist(),
                               context=md.context_lens.tolist(), step=step))
        return F.one_hot((ids + positions) % H, H).float()


class StandIn(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.mtp = RecordingHead()

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return hidden


def _request(tokens: list[int], blocks: list[int]) -> SimpleNamespace:
    return SimpleNamespace(token_ids=tokens, block_ids=blocks, mirror_slot=0)


def test_rows_drafts_acceptance_and_the_chain_kv() -> None:
    a = _request(list(range(100, 110)), [3, 4, 5])  # a decode row at position 9; blocks hold 12 tokens
    b = _request(list(range(200, 221)), [10, 11, 12, 13, 14, 15])  # a verify row: position 20, draft (7, 8)
    c = _request(list(range(300, 310)), [20])  # a prefill chunk of 3 of its 10 prompt tokens: samples nothing
    batch = [Scheduled(a, 9, 1, True), Scheduled(b, 20, 3, True, draft=(7, 8)), Scheduled(c, 0, 3, False)]
    rows = draft_rows(batch, BS)
    # the next token: sampled for every sampling row, else the prompt's (across the chunk's end too)
    assert rows.next_ids == [NO_TOKEN] * 4 + [301, 302, 303]
    assert (rows.base_rows, rows.first_samples, rows.table_rows, rows.capacity) == ([0, 1], [0, 1], [0, 1], [12, 24])
    assert rows.widths == [0, 2] and rows.width == 2

    model = StandIn()
    positions = torch.tensor([9, 20, 21, 22, 0, 1, 2])
    tables = torch.tensor([[3, 4, 5, 0, 0, 0], [10, 11, 12, 13, 14, 15], [20, 0, 0, 0, 0, 0]])
    md = AttentionMetadata(slot_mapping=torch.arange(7), block_tables=tables, context_lens=torch.tensor([10, 23, 3]),
                           query_start_loc=torch.tensor([0, 1, 4, 7]), max_query_len=3, max_context_len=23)
    tokens = torch.tensor([50, 7, 30, 31])  # b's first draft token accepted (7), its second not (30 != 8)
    sections = [torch.tensor(s, dtype=torch.int64) for s in rows.sections()]
    fed = torch.tensor([109, 220, 7, 8, 300, 301, 302])  # b's draft fed after its token
    drafts, accepted = MTPDrafter(model, 4, BS, 64).propose(torch.zeros(7, H), md, positions, fed, tokens,
                                                            torch.tensor([0, 1, 2, 3]), sections, rows.width)
    assert accepted.tolist() == [0, 1]
    first, *chain = model.mtp.calls
    assert first["ids"] == [50, 7, 30, 31, 301, 302, 303] and first["positions"] == positions.tolist()
    # a: from its row (position 9, id 50); b: from the row after its accepted token (position 21, id 30)
    d1 = [(50 + 9) % H, (30 + 21) % H]
    assert drafts[:, 0].tolist() == d1
    # the chain: a at positions 10, 11 (its last block), then 12: past its blocks, nothing written, read at 11;
    # b at 22, 23, then 24: past its blocks too
    assert [c["positions"] for c in chain] == [[10, 22], [11, 23], [11, 23]]
    assert [c["slots"] for c in chain] == [[5 * BS + 2, 15 * BS + 2], [5 * BS + 3, 15 * BS + 3], [-1, -1]]
    assert [c["context"] for c in chain] == [[11, 23], [12, 24], [12, 24]] and [c["step"] for c in chain] == [1, 2, 3]
    expected = [d1]
    for pos in ([10, 22], [11, 23], [11, 23]):
        expected.append([(d + p) % H for d, p in zip(expected[-1], pos)])
    assert drafts.tolist() == [list(x) for x in zip(*expected)]


def test_a_fully_accepted_draft_starts_from_its_last_row() -> None:
    b = _request(list(range(200, 221)), [10, 11, 12, 13, 14, 15])
    batch = [Scheduled(b, 20, 3, True, draft=(7, 8))]
    rows = draft_rows(batch, BS)
    model = StandIn()
    md = AttentionMetadata(slot_mapping=torch.arange(3), block_tables=torch.tensor([[10, 11, 12, 13, 14, 15]]),
                           context_lens=torch.tensor([23]), query_start_loc=torch.tensor([0, 3]), max_query_len=3,
                           max_context_len=23)
    drafts, accepted = MTPDrafter(model, 1, BS, 64).propose(
        torch.zeros(3, H), md, torch.tensor([20, 21, 22]), torch.tensor([220, 7, 8]), torch.tensor([7, 8, 40]),
        torch.tensor([0, 1, 2]), [torch.tensor(s, dtype=torch.int64) for s in rows.sections()], rows.width)
    assert accepted.tolist() == [2] and drafts.tolist() == [[(40 + 22) % H]]  # both accepted: the bonus token's row
