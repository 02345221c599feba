"""The checks the lessons' test cells call, and the nbgrader flow that runs them.

One module per lesson (`zerokit.grading.lessonNN`); each asks the same three questions of
the student's code, under the same names, plus what only its lesson has:

    numerics   the same numbers as one process running torch.optim.AdamW on the whole batch
               (weights AND optimizer state, after every step, each rank on its own data)
    memory     the stage's promise, measured: what each rank holds (shards, not copies)
    traffic    the stage's collectives, counted: which ones, how many elements, when

    lesson                check                    what it judges
    00 collectives        check_numerics           all-reduce from reduce-scatter + all-gather sums right
                          check_traffic            ... and moves what dist.all_reduce moves (2 x size)
    01 Adam               check_numerics           Adam/AdamW by hand vs torch.optim.AdamW, m, v, step
                          check_contract           param groups, LR scheduler, state_dict, no-grad parameters
                          check_zero_grad          zero_grad clears NaN and inf
                          check_memory             the 2Ψ + 2Ψ + KΨ formula vs measured bytes
    02 data parallel      check_average_gradients  exercise (a): the mean gradient on every rank
                          check_numerics           replicas equal, and equal to AdamW
                          check_traffic            one all-reduce of Ψ per step, no parameter broadcasts
    03 ZeRO-1             check_shard_range        exercise (a): equal padded shards, nothing dropped
                          check_numerics           weights and this rank's m, v shard vs AdamW
                          check_unused_parameters  no gradient on any rank: left alone; on some: updated;
                                                   a step count per parameter
                          check_memory             optimizer state ~ 8Ψ/N bytes per rank
                          check_traffic            reduce-scatter Ψ + all-gather Ψ, no all-reduce
                          check_param_groups       stretch (ungraded, try_stretch): several param groups
    04 ZeRO-2             check_numerics           gradient shards, weights, m and v vs AdamW
                          check_memory             no full gradient survives backward
                          check_traffic            one reduce-scatter per bucket, in order, in backward
                          check_unused_parameters  parameters without a gradient: no hang, no corruption
                          check_accumulation       several backward calls per step: the shards after each
                          check_clipping           stretch (ungraded, try_stretch): clipping sharded gradients
    05 ZeRO-3             check_gather_free        exercise 1: gather into, and free, a unit's buffer
                          check_numerics           gradient shards, weights, m and v vs AdamW
                          check_memory             parameters 1/N at rest, each unit freed after use
                          check_traffic            ≤ 3Ψ per step, and prefetch
    06 mixed precision    check_unscale            g / S in fp32
                          check_overflow_agreed    an inf on one rank skips the step on every rank
                          check_scale_schedule     backoff and growth
                          check_numerics           fp32 masters (taken before the cast), m, v vs AdamW; every
                                                   weight 16-bit, frozen ones too
                          check_overflow_step      nothing changes on a skipped step
    07 checkpoints        check_numerics           exercise (a): your save_shards, read back by zerokit's loader
                                                   on N and N' ranks, bit for bit; then AdamW's numbers
                          check_memory             exercise (a): each rank writes only its own shards (12 B each)
                          check_reshard_map        exercise (b): the N -> N' reads, padding never read (PyTorch's
                                                   planner cases among many), driving the loader on real ranks
                          check_consolidate        exercise (c): a strict fp32 state_dict, tied weights once
                          check_consolidate_memory exercise (c): peak ≤ the output + the largest parameter
                          check_answers            check your understanding
    08 beyond model state check_saved_bytes        exercise 1: bytes autograd saves, weights left out
                          check_saved_views        ... each storage once, and all of it
                          check_recompute          exercise 2: pre_forward under recomputation, vs AdamW
                          check_recompute_memory   ... post_forward frees in forward, blocks keep their input
                          check_recompute_traffic  ... one reduce-scatter, at most two gathers per bucket
                          check_offload_numerics   exercise 3: the disk-streamed Adam step vs AdamW
                          check_offload_memory     ... resident memory rises by chunks, not by the state
    09 Muon               check_numerics           whole-matrix Muon vs torch.optim.Muon (+ AdamW), momentum too
                          check_state              momentum only for the matrices a rank owns (~4Ψ/N)
                          check_traffic            ≤ 2Ψ per step: reduce to the owner, send the matrix back
                          check_balance            Newton-Schulz work of the busiest rank vs the mean
    10 capstone           check_losses             the training loop's first losses vs one process (SGD and AdamW)
                          check_data               each rank runs its slice of the global batch, in micro-batches
                          check_resume             killed after step k, resumed on another N: the same losses
    11 ZeRO++             check_hpz_numerics       exercise 1 (hpZ): bit for bit ZeRO3Adam, AdamW within rounding,
                                                   each secondary shard this rank's 1/k of its unit
                          check_hpz_traffic        ... backward's all-gathers: 0 bytes across nodes
                          check_hpz_memory         ... Ψ/N + Ψ/k held between forward and backward, then ZeRO-3's
                          check_quantize           exercise 2: int8 in blocks, max|x|/127 per block, half a step
                          check_qwz_gather         exercise 3: Ψ + 4Ψ/B bytes, each rank's chunk with its scales
                          check_qwz_training       ... 50 steps of ZeRO++ with your quantiser within 4% of exact
    12 FSDP2              check_dim0_chunk         exercise 1: each rank's rows of a dim 0 as torch.chunk cuts them
                          check_shard_param        ... the zero-padded storage and a DTensor Shard(0) viewing it, as
                                                   torch's distribute_tensor cuts it; its DCP checkpoint loaded
                                                   into torch's fully_shard
                          check_copy_in            exercise 2: the all-gather's output, this rank's row a view of it
                          check_copy_out           ... each parameter's buffer, its column block of every row; the
                                                   version counters left alone
                          check_chunk_cat          exercise 3: the reduce-scatter's input, rank-major, zero-padded
                          check_shard_grads        ... DTensor gradients viewing the output at the padded offsets

(The names the notebooks called before, e.g. check_zero1_numerics, check_matches_adamw, and
the `kind=` argument for `model=`, still work for a term: each module aliases them.)

One bug costs one check. Each check looks at one thing, and where a check needs another
exercise's piece it uses a reference for it (lesson 02's class checks use a reference
average_gradients; lesson 05's hook checks use zerokit's gather and free; lesson 06's
optimizer checks use zerokit's scaler; lesson 07's reads your checkpoint with zerokit's loader, and
drives that loader with your map; lesson 12's shard_param and shard_grads run with zerokit's
dim0_chunk), so a student loses the points of the check meant to
catch a bug, and only those. tests/test_grading_lessonNN.py hold each lesson's broken
versions and the exact checks each must fail.

The pieces:
    harness      run a check on real ranks; every failure becomes one readable line
    kit          what all lessons' checks share: the class guard, refusing zerokit's own
                 answer, the AdamW reference run, batches, small readers
    compare      assert_close with a message that says what differs, where
    questions    "check your understanding": numeric answers checked against digests
                 (visible) or values (hidden), naming wrong answers, never right ones
    lessons      generate lessons/ from solutions/ (nbgrader), check they have not drifted
    autograde    grade a folder of submissions: scores, feedback, grades.csv
"""
