"""The GPU path in one command: CUDA correctness against the CPU, then efficiency at 8B scale.

    python -m scripts.bench.gpu_check [--out results/gpu] [--shapes llama3.1-8b-instruct ...]
        [--lengths 4096 8192 ...] [--ratios 0.9 0.6] [--new-tokens 128] [--skip-efficiency]
        [--models llama3.1-8b-instruct-h8-kv2 ...] [--dtypes fp32 bf16 fp16] [--methods ...]
        [--efficiency-methods full snapkv ...] [--decode eager compiled] [--profile-lengths 4096 ...]
        [--skip-correctness] [--compare-paths] [--torch-paths] [--merge a.json b.json]

- ``correctness``: tiny random models, every method, on the CPU in fp32 (the reference) and on the
  device in fp32, bf16 and fp16: kept sets, residual sizes, budgets and the decode step's outputs.
- ``efficiency``: random models of the paper backbones' shapes: prefill, construction, peak memory
  and decode rate per request, eager and compiled, profiles and the alternative CUDA paths.
- ``report``: the machine block, the efficiency figure, the targets as printed lines, merged runs.
- ``cli``: the command line (``python -m scripts.bench.gpu_check`` runs ``cli.main``).

Without CUDA the same command runs everything at tiny sizes on the CPU (what the test suite does), so
the script cannot rot. Writes ``<out>/gpu_check.json`` and ``<out>/efficiency.{png,pdf}``.
"""
