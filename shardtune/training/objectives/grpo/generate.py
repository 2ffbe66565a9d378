"""GRPO's completions, sampled with the model being trained (any strategy: FSDP gathers the parameters for the
generation, KV cache on), each with its own random generator (shardtune.training.objectives.grpo.batches.sampling_seed)
so that
a completion does not depend on the rank that samples it or on the other rows of its batch.

The decode loop is ours, not ``generate``'s: the sampling draws from one generator per row (``generate`` draws from
the global one), and every rank runs the same number of forwards (a sharded model's forwards are collective), all
ranks stopping once every row of every rank has ended. Logits are processed as transformers' samplers do:
temperature, then top-k, then top-p.

Speed (bench/grpo.py --part profile shows where a step's time goes; bench/grpo_decode.py times one sampling call):
all rows of a call decode as one batch; a prompt shared by several rows (GRPO's num_generations completions of it) is
prefilled once and its KV cache copied to those rows into buffers preallocated for the whole decode, which each step
fills in place (PreallocatedLayer; transformers' DynamicLayer concatenates the whole cache every token); the attention
mask and positions are preallocated; whether every row has ended is read on the host every STOP_EVERY tokens, not
every token; on CPU the head's logits take MKL's faster layout where it is (head_logits). The decode keeps the
process's threads: one thread for the steps (2 available, 8 rows) was 7% faster at the demo preset but 8% slower at
demo-32k on a quiet machine (many times faster behind other jobs' threads: run such machines with OMP_NUM_THREADS=1,
as bench/grpo.py's --threads does). torch.compile of the model's forward does not pay on CPU: bench/grpo_decode.py
--compile took 143 s to compile at the demo preset (load 5) for a sampling call ~20% shorter after (CPU 113 vs ~140
ms).
"""

from __future__ import annotations

import contextlib
import inspect
from collections.abc import Iterator

import torch
import torch.nn.functional as F
from torch import nn
from torch.distributed.tensor import DTensor
from torch.profiler import record_function
from transformers.cache_utils import DynamicLayer

from shardtune.model.loss import head_computes, hf_model
from shardtune.runtime.distributed import all_reduce_sum

STOP_EVERY = 4  # tokens between the host's reads of whether every row has ended


def warp(logits: torch.Tensor, temperature: float, top_k: int, top_p: float, min_p: float = 0.0) -> torch.Tensor:
    """Next-token logits (rows, V) as the sampler sees them: divided by the temperature, then all but the top_k set
    to -inf, then all but the smallest set whose probability reaches top_p, then those less likely than min_p x the
    most likely (transformers' Temperature, TopK, TopP, MinP warpers, in generate's order)."""
    logits = logits.float() / temperature
    if 0 < top_k < logits.size(-1):
        kth = torch.topk(logits, top_k, dim=-1).values[:, -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if top_p < 1.0:
        ordered, order = torch.sort(logits, descending=False, dim=-1)
        cumulative = ordered.softmax(-1).cumsum(-1)
        remove = cumulative <= (1 - top_p)
        remove[:, -1] = False  # the most likely token always stays
        logits = logits.masked_fill(remove.scatter(1, order, remove), float("-inf"))
    if min_p > 0:
        probs = logits.softmax(-1)
        remove = probs < min_p * probs.amax(-1, keepdim=True)
        remove.scatter_(-1, probs.argmax(-1, keepdim=True), False)  # the most likely token always stays
        logits = logits.masked_fill(remove, float("-inf"))
    return logits


def penalise_repeats(logits: torch.Tensor, seen: torch.Tensor, penalty: float) -> torch.Tensor:
    """transformers' RepetitionPenaltyLogitsProcessor on a row's own tokens (``seen``, rows x V: its prompt and its
    completion so far; a padded batch's pad tokens are not the row's)."""
    penalised = torch.where(logits < 0, logits * penalty, logits / penalty)
    return torch.where(seen, penalised, logits)


@torch.no_grad()
def sample(
    model: nn.Module,
    strategy,
    prompts: list[list[int]],
    seeds: list[int],
    *,
    max_new_tokens: int,
    eos_ids: set[int],
    pad_id: int,
    temperature: float,
    top_k: int,
    top_p: float,
    device: torch.device,
    gather_whole: bool = False,
    min_p: float = 0.0,
    repetition_penalty: float = 1.0,
    budgets: list[int] | None = None,
) -> list[list[int]]:
    """One completion per prompt (with its eos when it ended), row i sampled from a generator seeded ``seeds[i]``,
    at most ``budgets[i]`` tokens long (default: max_new_tokens each). Collective: every rank calls it alike (its
    forwards may be collective), a rank without prompts too (it runs a stand-in row and returns [])."""
    stand_in = not prompts  # a rank with nothing to sample still runs the forwards the others run
    if stand_in:
        prompts, seeds, budgets = [[pad_id]], [0], [0]
    budgets = [max_new_tokens] * len(prompts) if budgets is None else [min(b, max_new_tokens) for b in budgets]
    inner = strategy.unwrap(model)
    was_training = inner.training
    inner.eval()
    try:
        with strategy.generating(model, gather_whole), strategy.autocast(), decoding_head(inner):
            decoder = Decoder(inner, prompts, max_new_tokens, pad_id, device)
            draw = Draw(seeds, eos_ids, budgets, pad_id, device, (temperature, top_k, top_p, min_p))
            if repetition_penalty != 1.0:
                draw.penalise(decoder.prompt_ids, decoder.prompt_attention, repetition_penalty)
            generated = decode(decoder, draw, max_new_tokens, device)
    finally:
        inner.train(was_training)
    if stand_in:
        return []
    ended = cut_at_eos(torch.stack(generated, 1).tolist(), eos_ids)
    return [row[:limit] for row, limit in zip(ended, budgets)]


def decode(decoder: Decoder, draw: Draw, max_new_tokens: int, device: torch.device) -> list[torch.Tensor]:
    """The tokens of every row, step by step (a row's pad after it ended). Whether every row of every rank has ended
    is read on the host every STOP_EVERY tokens only: the forwards in between run on rows that may all have ended
    (their tokens are pads, their draws unused), and every rank reads at the same steps, so all run as many forwards."""
    with record_function("grpo.prefill"):
        logits = decoder.prefill()
    generated = []
    with record_function("grpo.decode"):
        for step in range(max_new_tokens):
            tokens = draw.next(logits, step)
            generated.append(tokens)
            if step + 1 == max_new_tokens or ((step + 1) % STOP_EVERY == 0 and all_ended(draw.done, device)):
                break
            logits = decoder.step(tokens, step)
    return generated


def all_ended(done: torch.Tensor, device: torch.device) -> bool:
    """Whether every row of every rank has ended (collective: the one host read of the sampling)."""
    running = (~done).any().to(torch.float64).reshape(1)
    return bool(all_reduce_sum(running, device)[0] == 0)


class Decoder:
    """The model's side of sampling: the distinct prompts prefilled once (left-padded, so that every row's next token
    is at the same column), their KV cache expanded to the rows that share them (GRPO's num_generations completions
    of a prompt), then one forward of one token per row and step, the attention mask and positions preallocated."""

    def __init__(self, inner: nn.Module, prompts: list[list[int]], max_new_tokens: int, pad_id: int, device):
        accepted = inspect.signature(hf_model(inner).forward).parameters
        self.inner = inner
        self.cache_name = "cache" if "cache" in accepted else "past_key_values"
        # the last position's logits only: the prompts' (rows x prompt x vocabulary) would be the largest tensor
        self.last_only = {"logits_to_keep": 1} if "logits_to_keep" in accepted else {}
        distinct: dict[tuple[int, ...], int] = {}
        rows_of = [distinct.setdefault(tuple(p), len(distinct)) for p in prompts]
        self.distinct_ids, self.distinct_attention = left_padded([list(p) for p in distinct], pad_id, device)
        self.rows_of = torch.tensor(rows_of, device=device)
        self.prompt_ids = self.distinct_ids[self.rows_of]
        self.prompt_attention = self.distinct_attention[self.rows_of]
        rows, width = self.prompt_ids.shape
        self.attention = torch.zeros((rows, width + max_new_tokens), dtype=torch.long, device=device)
        self.attention[:, :width] = self.prompt_attention
        self.next_position = self.prompt_attention.sum(-1, keepdim=True)  # a row's first new token's position
        self.width = width
        self.past = None

    def prefill(self) -> torch.Tensor:
        """The distinct prompts' forward: the rows' next-token logits (rows, V), the cache expanded to the rows (into
        buffers preallocated for the whole decode, where its layers are transformers' plain dynamic ones)."""
        positions = (self.distinct_attention.cumsum(-1) - 1).clamp(min=0)
        logits = self.forward(self.distinct_ids, self.distinct_attention, positions)
        shared = len(self.rows_of) != len(self.distinct_ids)  # else every row's prompt is its own, in order
        capacity = self.attention.size(1)
        for index, layer in enumerate(self.past.layers):
            if type(layer) is DynamicLayer and layer.is_initialized:
                self.past.layers[index] = PreallocatedLayer(layer, self.rows_of if shared else None, capacity)
            elif shared:
                layer.batch_select_indices(self.rows_of)
        return logits[self.rows_of] if shared else logits

    def step(self, tokens: torch.Tensor, step: int) -> torch.Tensor:
        """The next-token logits after feeding the rows' tokens of ``step``."""
        self.attention[:, self.width + step] = 1
        attention = self.attention[:, : self.width + step + 1]
        return self.forward(tokens[:, None], attention, self.next_position + step)

    def forward(self, input_ids: torch.Tensor, attention: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        result = self.inner(
            input_ids=input_ids,
            attention_mask=attention,
            position_ids=positions,
            use_cache=True,
            **{self.cache_name: self.past},
            **self.last_only,
        )
        self.past = getattr(result, self.cache_name)
        return result.logits[:, -1].float()


class PreallocatedLayer(DynamicLayer):
    """A layer of the KV cache held in buffers sized for the whole decode (prompt and max_new_tokens): a step writes
    its token's keys and values in place, where transformers' DynamicLayer concatenates the whole cache again every
    token. ``keys`` / ``values`` are views of the filled part, so that the rest of DynamicLayer (the mask's sizes,
    the sequence length) reads them as its own."""

    def __init__(self, prefilled: DynamicLayer, rows: torch.Tensor | None, capacity: int):
        super().__init__()
        self.lazy_initialization(prefilled.keys, prefilled.values)
        self.key_buffer, self.keys = _buffer(prefilled.keys, rows, capacity)
        self.value_buffer, self.values = _buffer(prefilled.values, rows, capacity)

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
        start = self.keys.size(-2)
        end = start + key_states.size(-2)
        self.key_buffer[:, :, start:end] = key_states
        self.value_buffer[:, :, start:end] = value_states
        self.keys, self.values = self.key_buffer[:, :, :end], self.value_buffer[:, :, :end]
        return self.keys, self.values


def _buffer(states: torch.Tensor, rows: torch.Tensor | None, capacity: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(a buffer of ``capacity`` positions, its view holding ``states`` expanded to the rows): one copy of them."""
    selected = states if rows is None else states.index_select(0, rows)
    buffer = states.new_empty((*selected.shape[:-2], capacity, selected.size(-1)))
    buffer[:, :, : selected.size(-2)] = selected
    return buffer, buffer[:, :, : selected.size(-2)]


@contextlib.contextmanager
def decoding_head(inner: nn.Module) -> Iterator[None]:
    """While active, the model's output head computes its logits with :func:`head_logits` (the model's own forward
    still calls it, its wrappers' hooks run). Only a head whose forward is nn.Linear's, without a bias: a LoRA or
    quantized head (its own forward) keeps it."""
    base = hf_model(inner)
    head = base.get_output_embeddings() if hasattr(base, "get_output_embeddings") else None
    plain = isinstance(head, nn.Linear) and type(head).forward is nn.Linear.forward and head.bias is None
    if not plain:
        yield
        return
    with head_computes(head, lambda hidden: head_logits(hidden, head.weight)):
        yield


def head_logits(hidden: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """F.linear(hidden, weight), in the layout fastest for decoding: where :func:`transposed_head_wins`, W @ hidden.T
    transposed back as a view (the same sums, another order of them). Elsewhere (GPU, bf16 / fp16, a sharded weight,
    a small vocabulary) F.linear as the model does."""
    rows = hidden.reshape(-1, hidden.size(-1))
    if isinstance(weight, DTensor) or not transposed_head_wins(rows, weight):
        return F.linear(hidden, weight)
    return (weight @ rows.T).T.reshape(*hidden.shape[:-1], weight.size(0))


# where W @ h.T beat F.linear's h @ W.T on CPU in fp32 (MKL, AMD EPYC, 1 thread; bench/grpo_decode.py --head, two
# runs): 1.1-5x at 2-8 rows and 1.1-1.3x at 32 from an 8k vocabulary on (8k to 128k); 0.8x at 12 rows, ~1x at 16;
# 0.5-0.95x at 4-12 rows below 8k. bf16: 0.35-1x at 2-8 rows (F.linear kept)
TRANSPOSED_HEAD_MIN_VOCAB = 8192
TRANSPOSED_HEAD_ROWS = (range(2, 9), range(32, 1 << 30))


def transposed_head_wins(rows: torch.Tensor, weight: torch.Tensor) -> bool:
    """Whether the head's product over ``rows`` runs faster as W @ rows.T (as measured, see the constants above)."""
    if rows.device.type != "cpu" or not rows.dtype == weight.dtype == torch.float32:
        return False
    return weight.size(0) >= TRANSPOSED_HEAD_MIN_VOCAB and any(rows.size(0) in r for r in TRANSPOSED_HEAD_ROWS)


class Draw:
    """The sampler's side: each row's logits processed (repetition penalty, then warp) and its token drawn from its
    own generator (keyed_choice); a row that ended (eos or its budget) draws pads."""

    def __init__(self, seeds: list[int], eos_ids: set[int], budgets: list[int], pad_id: int, device, warping: tuple):
        self.generators = [torch.Generator(device=device).manual_seed(seed) for seed in seeds]
        self.eos = torch.tensor(sorted(eos_ids), device=device)
        self.budget = torch.tensor(budgets, device=device)
        self.done = self.budget <= 0
        self.pad_id, self.warping = pad_id, warping
        self.seen: torch.Tensor | None = None  # each row's tokens so far (with a repetition penalty)
        self.penalty, self.prompt = 1.0, None
        self.noise: torch.Tensor | None = None  # the draws' Gumbel noise, one buffer for every step

    def penalise(self, prompt_ids: torch.Tensor, prompt_attention: torch.Tensor, penalty: float) -> None:
        """A repetition penalty on each row's own tokens: its prompt's (not its pads) and those it draws."""
        self.penalty, self.prompt = penalty, (prompt_ids, prompt_attention)

    def next(self, logits: torch.Tensor, step: int) -> torch.Tensor:
        """Each row's token of ``step`` from its next-token logits (rows, V)."""
        if self.prompt is not None:
            if self.seen is None:  # the vocabulary's size comes with the first logits
                counts = torch.zeros(logits.shape, dtype=torch.long, device=logits.device)
                self.seen = counts.scatter_add_(1, *self.prompt) > 0
            logits = penalise_repeats(logits, self.seen, self.penalty)
        logits = warp(logits, *self.warping)
        if self.noise is None:
            self.noise = logits.new_empty(logits.shape, dtype=torch.float64)
        tokens = torch.where(self.done, self.pad_id, keyed_choice(logits, self.generators, self.noise))
        if self.seen is not None:
            self.seen.scatter_(1, tokens[:, None], True)
        self.done |= torch.isin(tokens, self.eos) | (self.budget <= step + 1)
        return tokens


def left_padded(prompts: list[list[int]], pad_id: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """(input_ids, attention_mask) of the prompts left-padded: every row's next token is at the same column."""
    longest = max(len(p) for p in prompts)
    input_ids = torch.full((len(prompts), longest), pad_id, dtype=torch.long)
    attention = torch.zeros((len(prompts), longest), dtype=torch.long)
    for i, ids in enumerate(prompts):
        input_ids[i, longest - len(ids) :] = torch.tensor(ids)
        attention[i, longest - len(ids) :] = 1
    return input_ids.to(device), attention.to(device)


def keyed_choice(
    logits: torch.Tensor, generators: list[torch.Generator], noise: torch.Tensor | None = None
) -> torch.Tensor:
    """One token per row drawn from softmax(logits) by the Gumbel-max trick, row i's noise from ``generators[i]``:
    no draw depends on the other rows (nor on how many there are). In place, in ``noise`` (rows x V float64, reused
    across steps when given): at a 32k vocabulary the noise is most of a decoding step's work besides the forward, and
    a fresh 2 MB tensor per step costs as much again in page faults. argmin(-log(-log u) - l) is argmax(l + Gumbel)
    to the bit (a - b is -(b - a) exactly; both take the first of ties)."""
    if noise is None:
        noise = torch.empty((len(generators), logits.size(-1)), dtype=torch.float64, device=logits.device)
    for row, generator in zip(noise, generators):
        row.uniform_(generator=generator)
    noise.clamp_(min=1e-300).log_().neg_().log_()
    return noise.sub_(logits).argmin(-1)


def cut_at_eos(rows: list[list[int]], eos_ids: set[int]) -> list[list[int]]:
    """Each row up to and with its first eos (all of it when it has none)."""
    out = []
    for row in rows:
        end = next((i + 1 for i, token in enumerate(row) if token in eos_ids), len(row))
        out.append(row[:end])
    return out
