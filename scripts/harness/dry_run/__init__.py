"""The dry run: a plan before the run, its configurations, what the result store already holds of
it, and its device hours per stage, read from a calibration file without torch or the model's
weights. Its parts: ``rates`` (the calibration file), ``workload`` (a task's samples and tokens, the
store's state), ``cost`` (a sample's seconds per stage), ``report`` (the printout) and ``calibrate``
(this device's rates measured, with torch).

``python run.py <overrides> dry_run=true`` prints them; ``dry_run=calibrate`` first measures this
device's rates (``scripts.harness.dry_run.calibrate``). The count follows what ``scripts.harness.grid``
runs for each sample that some configuration still lacks:

- **prefill**: one prefill of the context shared by the sample's configurations (one per
  configuration with ``share_prefill=false``), plus the accumulated attention H2O's scores need
  when such a method is in the grid (``prefill_with``); one forward of the question over the whole
  context when a configuration compresses query-aware (the full cache included), and one per
  query-agnostic configuration over its compressed cache;
- **construction**: one compression per compressing configuration, of the whole prompt (aware) or
  of the context (agnostic), a method's ratios in one setting sharing what does not depend on the
  ratio, a +ResKV one's k-means grown or shrunk with its ratio (``cost.construction_seconds``);
- **decode**: the task's generation length in steps for every batch of rows, the configurations
  cut into batches of views of the prefilled cache by the grid's own function
  (``reskv.batching.view_batches``: ``decode`` and ``decode_batch`` resolved for the calibration's
  device, the memory rule with the device's memory, the weights and the shape from the calibration
  file); a batch's step reads the shared slots once and each row's entries and appended slots
  (``reskv.batching.view_step_slots``), a row alone its budget (the full prompt for the full cache),
  the question's slots, and room for its answer.

Every answer is counted at its task's whole generation length: an upper bound, since answers that
stop early decode fewer steps. Prompt lengths are nominal (``task_workload``): RULER's prompt fills
its length less the tokens to generate; LongBench's is its task's mean length in words from the
benchmark's statistics, in tokens, truncated to the plan's length.

A calibration file (``results/calibration/<device kind>.json``, schema below) holds per backbone
the points each stage's rate is fitted to, or its coefficients, and says where each came from::

    {"schema": "reskv-calibration/1", "device": "<name>", "notes": [...],
     "memory_bytes": N,                         optional: the device's memory
     "backbones": {"<backbone>": {
        "weights_bytes": N, "shape": {"layers": .., "kv_heads": .., "query_heads": .., "head_dim": ..,
                                      "dtype_bytes": ..},   optional: for the memory rule
        "prefill": RATE in s,                  the context prefill, s its tokens
        "question": RATE in n,                 one forward of n question tokens
        "prefill_with": {"<label>": RATE in s, ...}, the prefill's extra time with that method
        "construction": {"<label>|<method>|base|reskv": RATE in s, ...}, s the compressed tokens,
                                               the RATE's "ratio" the one it was measured at
        "decode": {"eager"|"compiled": RATE in B, L}}}}   one step of B rows of L slots each

    RATE = {"terms": ["1", "s", "s2", ...], "points": [[x..., seconds], ...] or
            "coefficients": [...], "scale": 1.0, "source": "where the numbers come from"}

A construction is looked up by the configuration's label, then its method, then its kind
(``reskv`` for a ``+reskv`` method, else ``base``).
"""

from __future__ import annotations

from typing import Any

from scripts.harness.plan import PlanError


def check_dry_run(value: Any) -> None:
    if not isinstance(value, bool) and value != "calibrate":
        raise PlanError(f"dry_run {value!r}: choose from true, false, calibrate")
