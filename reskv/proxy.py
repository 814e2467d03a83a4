"""The validation proxy: each KV head's residual size chosen by a simulated decode inside the prompt
(reskv.md, "Validation proxy (per layer, per KV head): a simulated decode"; paper Eqs. valloss,
valproxy).

The last observed queries split into fit and validation queries; ``β`` is the first validation
position. Candidate caches are built from the prefix ``S' = [0, β)`` only, by the deployed cache's
rules (``M' = P' ∪ Top``, k-means entries of ``E' = S' \\ M'``), with the base rule applied to the
fit queries as if ``β - 1`` ended the prompt. A validation query at ``t >= β`` then attends the
candidate main cache ``M'``, the exact tokens ``β .. t`` and the residual entries ``R'``, as a
decode step attends the deployed cache: everything it sees precedes it, for every base method.

Every candidate of every head (and of every layer, when layers are stacked along the heads,
``reskv.scoring.stack_layers``) is built and judged in one pass whose shapes are planned from host
integers, so no shape is read back from the device and a GPU's host issues few ops: one sort of
the fit scores serves all candidates, since candidate ``r``'s ``M'`` is the top ``m'_r - |P'|`` of
that ranking plus ``P'`` and its ``E'`` the rest, in ranking order; one padded k-means per grid
level (and, where the nearest-centre kernel skips padding, for several levels and configurations
together); one joint attention for a configuration's losses. A grid's configurations that share a
proxy have their candidates built together (``candidate_rows``), each judged as alone, and choose
together (``choose_each``: one pass over every configuration's losses).
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass

import torch
from torch import Tensor

from reskv.attention import additive_mask, joint_attention, joint_bias
from reskv.config import DEVICE_MEMORY_SHARE, ResidualConfig, candidate_sizes
from reskv.decode_rule import DecodeRule
from reskv.residual import ResidualEntries, cluster_rows, level_row_groups, nested_families
from reskv.scoring import LayerObservation, TokenScorer, attention_outputs
from reskv.selection import gather_rows, padding_bias, score_order, token_rows, uploaded


def joined(parts: list[Tensor]) -> Tensor:
    """``torch.cat`` of ``parts`` along the first dimension; the one part itself when alone (a cat of
    one is a copy: an op on a GPU's host)."""
    return parts[0] if len(parts) == 1 else torch.cat(parts)


def observation_split(obs: LayerObservation, config: ResidualConfig) -> tuple[slice, slice] | None:
    """Fit and validation query ranges inside the observed queries.

    The paper's 96 + 32 when at least 128 queries were observed; a shorter prompt splits what
    it has 3:1 (documented fallback); fewer than 2 queries leave nothing to validate on.
    """
    observed = obs.queries.shape[1]
    if observed < 2:
        return None
    if observed >= config.observation_window:
        validation = config.validation_queries
        fit = config.fit_queries
    else:
        validation = max(1, observed // 4)
        fit = observed - validation
    start = observed - fit - validation
    return slice(start, start + fit), slice(observed - validation, observed)


def grouped(queries: Tensor, num_kv_heads: int) -> Tensor:
    """``[H, n, d] -> [H_kv, G*n, d]``: query heads stacked per KV group."""
    return queries.reshape(num_kv_heads, -1, queries.shape[-1])


@dataclass
class CandidateCaches:
    """Candidate caches over ``S'``, one per row: row ``i`` is candidate ``i // H`` of head ``i % H``."""

    heads: Tensor  # [rows]: the head each row belongs to
    main_rows: Tensor  # [rows, n]: M' in position order, padded, as ``gather_rows`` indexes the layer
    main_counts: Tensor  # [rows]: M''s slots in use; the rest of a row is padding
    padded: bool  # whether any row is padded (host)
    residual: ResidualEntries  # [rows, r_max]
    entry_counts: Tensor  # [rows]: entry slots in use, min(r, |E'|); the rest hold no entry
    evicted: Tensor  # [rows]: |E'|

    @property
    def main_bias(self) -> Tensor | None:
        """``[rows, 1, n]``: -inf on padding (``padding_bias``, built on each call), None when no row is
        padded."""
        return padding_bias(self.main_counts, self.main_rows.shape[1]) if self.padded else None

    def part(self, rows: slice) -> CandidateCaches:
        """The caches of ``rows`` (views), laid out as all rows' (the same slots and padding)."""
        return self.laid_out(rows, self.main_rows.shape[1], self.residual.keys.shape[1], self.padded)

    def laid_out(self, rows: slice, main_slots: int, entry_slots: int, padded: bool) -> CandidateCaches:
        """The caches of ``rows`` (views) in ``main_slots`` main and ``entry_slots`` entry slots, with
        the main cache's padding bias only where ``padded``: a row's slots past its own are padding, so
        rows built beside wider ones are laid out as if built alone (``ValidationProxy.candidate_sets``)."""
        residual = self.residual
        return CandidateCaches(
            self.heads[rows],
            self.main_rows[rows, :main_slots],
            self.main_counts[rows],
            padded,
            ResidualEntries(*(part[rows, :entry_slots] for part in residual.fields())),
            self.entry_counts[rows],
            self.evicted[rows],
        )


# On CUDA with Triton, candidates' errors come from ``reskv.loss_kernel`` (one launch for every row of
# every configuration built together, M' read by index, no joined buffers: ~45 ops a configuration
# fewer on the host) where the rule is the shared softmax (``fused_losses``). Off until a GPU has
# checked and timed it (``scripts.bench.gpu_check.first``'s kernels and profile stages).
CUDA_FUSED_LOSSES = False


def fused_losses(keys: Tensor, rule: DecodeRule) -> bool:
    """Whether ``reskv.loss_kernel`` computes the errors of candidates over ``keys`` under ``rule``:
    ``CUDA_FUSED_LOSSES``, CUDA with Triton, and the shared softmax."""
    if not (CUDA_FUSED_LOSSES and keys.is_cuda and rule.shared_softmax):
        return False
    from reskv import nearest_kernel  # imports Triton (slow to import), which the CPU never runs

    return nearest_kernel.available()


# A candidate row's int64 index tables while ``ValidationProxy.candidate_sets`` builds them, per token
# before β at most: the ranking gathered, M''s columns, and their sort's values and indices.
CANDIDATE_TABLE_BYTES = 4 * 8


def loss_block_bytes(device: torch.device) -> float:
    """The bytes a block of candidate rows' losses may hold (``ValidationProxy.caches_errors``): on CUDA
    a ``DEVICE_MEMORY_SHARE`` of the device's memory, as the k-means' distance block (at 32K tokens,
    ratio 0.6 and the 8B shape all 1,280 rows of one ratio's candidates at once held ~40 GB: their
    main caches gathered, the joined fp32 keys and values, the logits); on CPU no bound (one call for
    all rows, whose few GB an embedded model's proxy never nears, and the same bits as blocks:
    tests/test_proxy.py)."""
    if device.type == "cuda":
        return torch.cuda.get_device_properties(device).total_memory // DEVICE_MEMORY_SHARE
    return math.inf


class ValidationProxy:
    """Per-head residual size chosen on held-out validation queries by a simulated decode.

    ``budgets`` passed to the methods are the heads' deployed budgets ``b_h`` (AdaKV: from the
    deployed scores), so a candidate plus the exact validation tokens fills the same ``b_h`` slots
    as the deployed cache. ``obs`` may stack ``num_layers`` layers along its heads.
    """

    def __init__(
        self,
        obs: LayerObservation,
        scorer: TokenScorer,
        config: ResidualConfig,
        split: tuple[slice, slice],
        num_layers: int = 1,
    ):
        fit, validation = split
        self.obs, self.scorer, self.config = obs, scorer, config
        positions = obs.query_positions
        validation_positions = positions[validation]  # the last positions of the prompt
        self.boundary = validation_positions[0]  # β
        self.validation_count = len(validation_positions)
        # S' is read in place: candidates gather its rows from the layer's own keys and values
        # (positions below β), so no copy of the prefix sits beside the losses' buffers: +ResKV's peak
        # is its base's plus the proxy's buffers (reskv.md, "Where the full cache lives").
        self.fit_scores = scorer.stacked_score(
            obs.keys[:, : self.boundary], obs.queries[:, fit], positions[fit], obs.scaling, num_layers
        )
        self.prefix_window = min(scorer.window, self.boundary)  # |P'|
        # One ranking of S' \ P' serves every candidate (module docstring).
        self.fit_order = score_order(self.fit_scores[:, : self.boundary - self.prefix_window])
        validation_queries = obs.queries[:, validation]
        self.validation_queries = grouped(validation_queries, obs.num_kv_heads)
        # o_S(t): full causal attention over 0 .. t.
        self.full_output = attention_outputs(
            validation_queries, obs.keys, obs.values, validation_positions, obs.scaling
        )

    @functools.cached_property
    def exact_bias(self) -> Tensor:
        """The exact tokens β .. s-1 follow every candidate main cache; query t sees those <= t: the
        torch path's bias over them ``[G |validation|, s - β]`` (``loss_kernel`` masks them itself)."""
        exact = torch.arange(self.boundary, self.obs.seq_len, device=self.obs.keys.device)
        return additive_mask(exact[None, :] <= exact.repeat(self.obs.group_size)[:, None])

    def candidates(self, budgets: list[int], sizes: list[list[int]]) -> CandidateCaches:
        """The caches over ``S'`` of candidates ``sizes`` (``[C][H]`` host ints, 0 = no entries) for
        heads with deployed budgets ``budgets``: ``m' = b - r - |validation|`` main slots each."""
        return self.candidate_sets([(budgets, sizes)])[0]

    def candidate_sets(self, sets: list[tuple[list[int], list[list[int]]]]) -> list[CandidateCaches]:
        """``candidates`` of several sets of heads' budgets and candidates' sizes (a grid's ratios), built
        together (``candidate_rows``), each set's caches views laid out as that set's built alone
        (``CandidateCaches.laid_out``), so its losses are the same bits as alone (``caches_errors``)."""
        every_row, layouts = self.candidate_rows(sets)
        return [every_row.laid_out(*layout) for layout in layouts]

    def candidate_rows(
        self, sets: list[tuple[list[int], list[list[int]]]]
    ) -> tuple[CandidateCaches, list[tuple[slice, int, int, bool]]]:
        """Every row of ``sets``' candidates, each set's rows after the last's, built together from one
        upload of their host tables, one gather of the ranking and one k-means for all rows (grouped by
        ``level_row_groups``: where the nearest-centre step skips padding, rows of every set share
        groups; elsewhere each candidate's rows form their own, as alone); and each set's layout alone,
        ``CandidateCaches.laid_out``'s arguments."""
        keys, values, window, boundary = self.obs.keys, self.obs.values, self.prefix_window, self.boundary
        device = keys.device
        heads, budget_of, residual = [], [], []
        spans = []  # a set's rows: (first, heads, candidates), its candidates in turn over its heads
        for budgets, sizes in sets:
            spans.append((len(heads), len(budgets), len(sizes)))
            for row in sizes:
                heads += range(len(budgets))
                budget_of += budgets
                residual += row
        main = [
            max(budget - size - self.validation_count, 0)
            for budget, size in zip(budget_of, residual, strict=True)
        ]
        top = [max(slots - window, 0) for slots in main]  # from the ranking; the rest from P'
        kept_window = [min(window, slots) for slots in main]
        counts = [t + w for t, w in zip(top, kept_window, strict=True)]
        evicted = [boundary - count for count in counts]
        if any(size > 0 and w < window for size, w in zip(residual, kept_window, strict=True)):
            raise ValueError("a candidate with entries must keep all of P' (candidate_sizes skips it)")
        residual = [min(size, points) for size, points in zip(residual, evicted, strict=True)]
        heads_t, top_t, evicted_t, kept_window_t, residual_t, counts_t = uploaded(
            [heads, top, evicted, kept_window, residual, counts], device
        )
        order = self.fit_order.index_select(0, heads_t)
        longest, widest = max(counts), max(top)
        # M' in position order: the ranking's top ``top_i`` and P' newest first, unused columns past
        # the end (``boundary``), sorted; a row's padding then sits after its real slots.
        slot = torch.arange(max(widest, window), device=device)
        columns = torch.cat(
            [
                order[:, :widest].masked_fill(slot[:widest] >= top_t[:, None], boundary),
                (boundary - 1 - slot[:window])
                .expand(len(heads), -1)
                .masked_fill(slot[:window] >= kept_window_t[:, None], boundary),
            ],
            dim=1,
        )
        positions = columns.sort(dim=1).values[:, :longest].clamp_(max=boundary - 1)
        levels = [
            [row for row in range(first + c * width, first + (c + 1) * width) if residual[row]]
            for first, width, candidates in spans
            for c in range(candidates)
        ]
        # A head's candidates of one budget are nested: their first Lloyd step is shared.
        families = nested_families([row for level in levels for row in level], heads, top, residual, evicted)
        groups = level_row_groups(levels, residual, evicted, keys, families)
        entries = cluster_rows(
            keys, values, heads_t, order, top_t, evicted_t, residual_t, groups, self.config.kmeans_iterations,
            families,
        )  # fmt: skip
        main_rows = token_rows(heads_t, positions, keys)  # one index for both gathers
        every_row = CandidateCaches(
            heads_t, main_rows, counts_t, min(counts) < longest, entries, residual_t, evicted_t
        )
        layouts = []
        for first, width, candidates in spans:
            rows = slice(first, first + width * candidates)
            own = counts[rows]
            layouts.append((rows, max(own), max(residual[rows]), min(own) < max(own)))
        return every_row, layouts

    def table_batches(
        self, sets: list[tuple[list[int], list[list[int]]]]
    ) -> list[list[tuple[list[int], list[list[int]]]]]:
        """``sets`` (as ``candidate_sets`` takes them) in turn, in as few batches as keep a batch's index
        tables (``CANDIDATE_TABLE_BYTES`` a row and token before β) within ``loss_block_bytes``, a set
        a batch at least (at 32K tokens, every ratio's of two rules would hold several loss blocks:
        results/README.md); on CPU one batch."""
        limit = loss_block_bytes(self.obs.keys.device)
        batches, held = [], 0
        for budgets, sizes in sets:
            table = len(budgets) * len(sizes) * self.boundary * CANDIDATE_TABLE_BYTES
            if not batches or held + table > limit:
                batches.append([])
                held = 0
            batches[-1].append((budgets, sizes))
            held += table
        return batches

    def candidate(self, budgets: Tensor, sizes: Tensor) -> CandidateCaches:
        """One candidate's caches for every head (sizes ``[H]``)."""
        return self.candidates(budgets.tolist(), [sizes.tolist()])

    def caches_errors(self, caches: CandidateCaches) -> Tensor:
        """``||ô_r(q) - o_S(q)||²`` ``[rows, G * |validation|]`` per validation query and group head
        (grouped order: query head major), ``ô_r`` the decode rule with its gate over ``M' ∪ {β..t}``:
        ``block_errors`` of blocks of rows within ``loss_block_bytes``, every block laid out as all
        rows would be (the same slots, so the same bits); where ``fused_losses``, ``reskv.loss_kernel``'s
        for every row at once."""
        obs, rows = self.obs, caches.heads.shape[0]
        if fused_losses(obs.keys, self.config):
            from reskv import loss_kernel

            return loss_kernel.errors(
                self.validation_queries, self.full_output, obs.keys, obs.values, caches.heads,
                caches.main_rows, caches.main_counts, caches.residual, caches.entry_counts, self.boundary,
                self.validation_count, obs.scaling, self.config,
            )  # fmt: skip
        slots = caches.residual.keys.shape[1] + caches.main_rows.shape[1] + obs.seq_len - self.boundary
        queries, dim = self.validation_queries.shape[1], obs.keys.shape[-1]
        # A row's gathered main cache, its joined fp32 keys and values, and its logits.
        row_bytes = (
            caches.main_rows.shape[1] * dim * 2 * obs.keys.element_size() + slots * (2 * dim + queries) * 4
        )
        block = int(max(1, min(rows, loss_block_bytes(obs.keys.device) // row_bytes)))
        return torch.cat(
            [self.block_errors(caches.part(slice(start, start + block))) for start in range(0, rows, block)]
        )

    def block_errors(self, caches: CandidateCaches) -> Tensor:
        """``caches_errors`` of one block of rows."""
        obs, heads, residual = self.obs, caches.heads, caches.residual
        rows, main_slots = heads.shape[0], caches.main_rows.shape[1]
        exact_keys = obs.keys[:, self.boundary :].index_select(0, heads)
        exact_values = obs.values[:, self.boundary :].index_select(0, heads)
        exact = exact_keys.shape[1]
        # One fp32 buffer [entries ; M' ; β .. s-1] as a decode step reads it (joint_attention), each
        # part converted as it is copied in: the joined buffer exists once, not also in the cache's dtype.
        slots = residual.keys.shape[1] + main_slots + exact
        keys = torch.empty(rows, slots, exact_keys.shape[-1], device=exact_keys.device)
        values = torch.empty(rows, slots, exact_values.shape[-1], device=exact_values.device)
        main_keys, main_values = (
            gather_rows(obs.keys, caches.main_rows),
            gather_rows(obs.values, caches.main_rows),
        )
        torch.cat([residual.keys, main_keys, exact_keys], dim=1, out=keys)
        torch.cat([residual.values, main_values, exact_values], dim=1, out=values)
        del main_keys, main_values
        # The bias in two terms, per row (the entries' population, M''s padding) and per query (the
        # exact tokens' causality), never their [rows, G * |validation|, slots] sum, which would
        # weigh most in +ResKV's peak memory.
        padding = caches.main_bias
        row_bias = joint_bias(
            residual.log_counts,
            None if padding is None else torch.nn.functional.pad(padding, (0, exact)),
            main_slots + exact,
            self.config,
        )
        query_bias = torch.nn.functional.pad(self.exact_bias, (slots - exact, 0))
        output, _ = joint_attention(
            self.validation_queries.index_select(0, heads),
            keys,
            values,
            (row_bias, query_bias),
            residual.keys.shape[1],
            obs.scaling,
            self.config,
            caches.evicted / self.boundary,  # |E'| / β, for the no-shared-softmax ablation
        )
        return (output - self.full_output.index_select(0, heads)).square_().sum(dim=-1)

    def errors(self, budgets: Tensor, sizes: Tensor) -> Tensor:
        """``caches_errors`` ``[H, G * |validation|]`` of one candidate (sizes ``[H]``)."""
        return self.caches_errors(self.candidate(budgets, sizes))

    def losses(self, budgets: Tensor, sizes: Tensor) -> Tensor:
        """``L_r`` ``[H]``: the mean of ``errors`` over validation queries and group heads."""
        return self.errors(budgets, sizes).mean(dim=-1)

    def choose(self, budgets: list[int] | Tensor) -> Tensor:
        """``choose_each`` of one deployed cache's heads' budgets."""
        return self.choose_each([budgets.tolist() if isinstance(budgets, Tensor) else budgets])[0]

    def sets_errors(self, every_row: CandidateCaches, layouts: list[tuple[slice, int, int, bool]]) -> Tensor:
        """``caches_errors`` of every row of ``candidate_rows``' sets, in order, each set's as alone:
        where ``fused_losses``, one launch for them all (``reskv.loss_kernel`` runs each row over its own
        slots, so the layout does not matter); else set by set, each laid out as alone."""
        if fused_losses(self.obs.keys, self.config):
            return self.caches_errors(every_row)
        return joined([self.caches_errors(every_row.laid_out(*layout)) for layout in layouts])

    def choose_each(self, budget_sets: list[list[int]]) -> Tensor:
        """For each of ``budget_sets`` (a deployed cache's heads' budgets: a grid's ratios),
        ``r* = argmin_{r>0} L_r`` per head (the first candidate on ties), kept only where
        ``L_{r*} < (1 - delta) * L_0``, else 0; 0 where no candidate is admissible. ``[sets, H]`` long
        on the device: nothing is read back. Every set's candidates are built together
        (``candidate_rows``), each set's losses as that set's alone, and every set chooses in one pass:
        its losses gathered by a host table into ``[sets, 1 + C, H]`` (``L_0`` first, candidates past a
        set's own have size 0, never chosen)."""
        device, heads = self.obs.keys.device, len(budget_sets[0])
        grids = [
            [
                sizes
                for sizes in candidate_sizes(self.config, budgets, self.prefix_window, self.validation_count)
                if any(sizes)
            ]
            for budgets in budget_sets
        ]
        judged = [
            (budgets, [[0] * len(budgets), *admissible])
            for budgets, admissible in zip(budget_sets, grids, strict=True)
            if admissible
        ]
        if not judged:
            return torch.zeros(len(budget_sets), heads, dtype=torch.long, device=device)
        losses = joined(
            [self.sets_errors(*self.candidate_rows(batch)) for batch in self.table_batches(judged)]
        ).mean(dim=-1)
        # Host tables [sets, 1 + C, H]: each loss's row in ``losses`` (row 0 where a set has no such
        # candidate: its size is 0) and each candidate's sizes (0 for L_0 and past a set's own).
        widest, first = max(len(admissible) for admissible in grids), 0
        rows, sizes = [], []
        for admissible in grids:
            count = 1 + len(admissible) if admissible else 0
            rows += [first + candidate * heads + head for candidate in range(count) for head in range(heads)]
            rows += [0] * (1 + widest - count) * heads
            sizes += [size for candidate in [[0] * heads, *admissible] for size in candidate]
            sizes += [0] * (widest - len(admissible)) * heads
            first += count * heads
        rows_t, sizes_t = uploaded([rows, sizes], device).unflatten(1, (len(budget_sets), 1 + widest, heads))
        every = losses.index_select(0, rows_t.flatten()).view(rows_t.shape)
        main_only, candidate_losses, candidate_sizes_t = every[:, 0], every[:, 1:], sizes_t[:, 1:]
        candidate_losses.masked_fill_(candidate_sizes_t == 0, float("inf"))
        best = candidate_losses.argmin(dim=1, keepdim=True)  # the first of equal losses
        accepted = candidate_losses.gather(1, best)[:, 0] < (1 - self.config.delta) * main_only
        return candidate_sizes_t.gather(1, best)[:, 0] * accepted

    def fit_selection(self) -> tuple[Tensor, int]:
        """Scores ``[H_kv, s]`` and protected window for ``final_selection="fit"``: the deployed cache
        is the validated one, ``M' ∪ {β .. s-1}`` plus the entries of ``E' = S' \\ M'``.

        This project's mapping of the fit scores (which cover ``S'``) to the whole prompt: the
        tokens from ``β`` on are kept exact, as in the simulation, by protecting ``P' ∪ [β, s)``
        (the last ``|P'| + |validation|`` tokens, contiguous); the fit scores rank the rest. With
        ``m = b - r`` main slots this selects exactly the candidate's ``M'`` (same scores, same
        ties), and the evicted side is ``E'``, so the residual entries are the candidate's too.
        """
        padding = self.fit_scores.new_zeros(self.fit_scores.shape[0], self.validation_count)  # protected
        return torch.cat([self.fit_scores, padding], dim=1), self.prefix_window + self.validation_count
