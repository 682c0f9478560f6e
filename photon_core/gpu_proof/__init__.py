"""The megakernel's proof on a GPU (/work/shared/specs/megakernel.md, "Proving it on a GPU"), as
parts a driver runs per family, batch and weight dtype; bench/gpu_proof.py is that driver, and its
`--dry-run` runs the same parts on the CPU interpreter at tiny shapes (the tests do).

    checks      bookkeeping: Sizes, Checks, Ctx (results written after every configuration),
                error measures, the rule a step's values are judged by (judge_profile),
                CUDA-event timing
    float64     the fp32 reference run in float64 (the truth of that rule)
    profile     a launched step's per-layer errors against float64, beside the fp32 reference's
    families    Whisper's and Moondream 2's decode steps on random weights of real shapes
                (families compiled from their step graph alone: megakernel.graph_family)
    build       compiled steps shared by every part, and what the parts do to their buffers
    steps       consecutive steps against run_reference and each family's reference_step
    races       race stress, NaN poisoning, the positive control (a dropped wait)
    liveness    a never-signalled wait returns and is reported (in a child process)
    rounds      the production decode loop: host-driven, replayed and device rounds agree
    timing      time per step against the HBM floor and the per-op step in a CUDA graph
    prewarm     Triton compiles in worker processes while the host builds
    children    parts in child processes (each family's rounds) and the GPU lock
    costs       what each part cost on the first GPU run (H200), for the plan
    plan        a profile's seconds per part, predicted from those costs
    results_file  every GPU script's results written whole (a run killed at its limit keeps them)

It imports model code (Whisper's and Moondream 2's steps as fixtures), so it lives outside
photon_core.megakernel, which imports none; nothing in the runtime imports it.
"""
