r"""zerokit against PyTorch's own ZeRO implementations, on one model, one data stream, one run.

    python -m zerokit.bench                          # world size 2, the small transformer
    python -m zerokit.bench --world-size 4 --model medium --steps 50
    python -m zerokit.bench --model mlp              # a plain MLP of 3.8 M parameters instead
    python -m zerokit.bench --fsdp2                  # zerokit.fully_shard beside torch's, N = 2 and 4
    python -m zerokit.bench.demo                     # `make demo`: zerokit's stages beside the paper

Each stage (data parallel, ZeRO-1, ZeRO-2, ZeRO-3) runs three times: as its PyTorch peer (DDP +
AdamW, ZeroRedundancyOptimizer, FSDP2), as zerokit's lesson class, and as zerokit in PyTorch's
shape (DataParallel, ZeRO1/ZeRO2 with torch's AdamW, FullyShard: the shell over zerokit.fully_shard).
All run in one `zerokit.launch` (one process tree): each rank builds a configuration fresh from the same
seed, trains it on the same batches (rank r takes its slice of each global batch), measures
it, frees it and builds the next. Per configuration: median step time beside the floor
(the same compute with perfect software), bytes communicated per step beside theory, peak
memory by category, and the final loss's difference from DDP + AdamW's.

The files, in the order a run goes through them (each module's docstring says what it
measures and how):

    workload.py    model presets, AdamW's hyperparameters, each rank's slice of the data, one step
    systems.py     the eight configurations: each stage by zerokit and by its PyTorch peer
    accounting.py  memory by category and bytes communicated, sampled over one instrumented step
    timing.py      how a step is timed: a barrier, device syncs, the slowest rank
    floor.py       a stage's floor: compute with no communication, plus the raw collectives
    runs.py        one configuration's run; a stage's runs and floor timed in rotation
    worker.py      what every rank runs: warm up, then each selected stage in turn
    summary.py     the ranks' measurements put together: medians, slowest ranks, ratios
    table.py       the table on stdout
    plot.py        the figure
    runner.py      run(): launch, summarise, write the JSON and the plot
    cli.py         main(): the command line; __main__.py runs it
    sweep.py       `--sweep`: step time, model state and traffic against Ψ and N, beside theory
    fsdp2.py       `--fsdp2`: zerokit.fully_shard beside torch's fully_shard with the same calls, N = 2 and 4

Output: the table on stdout, `bench-results/bench-ws<N>.json` and `bench-ws<N>.png`.

The demo measures zerokit's stages alone, beside the ZeRO paper's theory
(`bench-results/demo_memory.png`):

    demo.py        `make demo`: memory by category at rest and at its peak, traffic per step
    buffers.py     what ZeRO-2/3 hold beyond the paper's table, derived from buckets and units

`make gpu-check` (gpu_check.py) runs every CUDA path of the course on one GPU, with:

    odd_shapes.py     zerokit's optimizers against torch.optim's on odd sizes, bit for bit
    lesson_grades.py  the lessons' graded checks with the ranks' tensors on the device
    opcount.py        what one step asks of a GPU (operations, host reads), counted on the CPU

This file imports nothing: importing one module of the package (the demo's workers import
the stage factory) should not pay for FSDP and the rest of the bench.
"""
