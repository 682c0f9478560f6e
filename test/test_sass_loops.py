"""photon_core/kernels/sass_loops.py: reading a K loop's trip out of SASS (compile-only evidence for
issue 38: bytes in flight, vector widths, barriers and shared-memory traffic inside the loop).

The parser runs on a hand-written listing in nvdisasm -gi's format (no GPU, no compile); the
compiled megakernel builds are read by test_megakernel_variants.py."""
import os

os.environ["TRITON_INTERPRET"] = "1"  # photon_core.kernels imports Triton: as every other test module has it

from photon_core.kernels import sass_loops as sl  # noqa: E402

K = "/src/photon_core/megakernel/kernel.py"

# A task loop (label .L_x_1, closed by the branch at 0x0100) around a K loop (.L_x_2 .. 0x00c0):
# two 16-byte weight loads from line 449 (inlined at 411, inside _task_linear at 30), one 2-byte
# load from 449 after the first use, a shared-memory layout change with a barrier, the multiply, a
# spill store (its reload is outside the K loop).
LISTING = f"""
_megakernel:
.L_x_1:
	//## File "{K}", line 20
        /*0000*/                   LDG.E.STRONG.GPU R2, desc[UR4][R40.64] ;
.L_x_2:
	//## File "{K}", line 449 inlined at "{K}", line 411
	//## File "{K}", line 411 inlined at "{K}", line 30
	//## File "{K}", line 30
        /*0010*/                   LDG.E.128 R12, desc[UR4][R4.64] ;
        /*0020*/               @P1 LDG.E.128 R16, desc[UR4][R6.64] ;
	//## File "{K}", line 445 inlined at "{K}", line 30
	//## File "{K}", line 30
        /*0030*/                   IADD3 R4, P0, R4, 0x80, RZ ;
        /*0040*/                   FFMA R20, R13, R8, R20 ;
	//## File "{K}", line 449 inlined at "{K}", line 30
	//## File "{K}", line 30
        /*0050*/                   LDG.E.U16 R22, desc[UR4][R6.64+0x100] ;
        /*0060*/                   STS.128 [R9], R16 ;
        /*0070*/                   BAR.SYNC.DEFER_BLOCKING 0x0 ;
        /*0080*/                   LDSM.16.M88.4 R24, [R9] ;
        /*0090*/                   FFMA R20, R24, R22, R20 ;
        /*00a0*/                   ISETP.GE.AND P0, PT, R4, R5, PT ;
        /*00b0*/                   STL [R1+0x8], R20 ;
        /*00c0*/              @!P0 BRA `(.L_x_2) ;
	//## File "{K}", line 20
        /*00d0*/                   RED.E.ADD.STRONG.GPU desc[UR4][R40.64], R3 ;
        /*00e0*/                   LDL R20, [R1+0x8] ;
        /*0100*/                   BRA `(.L_x_1) ;
"""

SOURCE = ["def _task_linear(row):"] * 40 + ["def _linear_acc(row):"] * 460


def _loops():
    insns, labels = sl.instructions(LISTING)
    names = sl.enclosing_functions(["def _megakernel():"] * 25 + SOURCE[25:])
    return insns, labels, sl.loops(insns, labels, "kernel.py", {449}, names)


def test_instructions_carry_their_innermost_line_and_the_lines_they_were_inlined_at():
    insns, labels, _ = _loops()
    first = next(i for i in insns if i.address == 0x10)
    assert (first.opcode, first.line, first.chain) == ("LDG.E.128", 449, (449, 411, 30))
    assert first.operands[0] == "R12"
    predicated = next(i for i in insns if i.address == 0x20)
    assert predicated.opcode == "LDG.E.128" and predicated.line == 449
    assert labels == {".L_x_1": 0x0, ".L_x_2": 0x10}


def test_the_innermost_weight_loop_and_its_trip():
    _, _, found = _loops()
    assert len(found) == 1                        # the task loop holds it: only the K loop is innermost
    loop = found[0]
    assert (loop.start, loop.end, loop.lines) == (0x10, 0xc0, (449,))
    assert loop.loads == {"LDG.E.128": 2, "LDG.E.U16": 1}
    assert loop.weight_bytes == 16 + 16 + 2
    # R13 (the first load's second word) is read at 0x40: the 2-byte load after it is not in flight
    assert loop.in_flight_bytes == 32
    assert (loop.barriers, loop.shared, loop.local) == (1, 2, 1)
    assert loop.task == "_task_linear"


def test_a_load_that_is_not_a_weight_site_is_not_counted():
    insns, labels = sl.instructions(LISTING)
    assert sl.loops(insns, labels, "kernel.py", {450}) == []
    assert sl.loops(insns, labels, "other.py", {449}) == []


def only_loop(body: str, line: int = 449, names: dict | None = None) -> sl.Loop:
    """The one weight loop of a listing: `body` (instructions, labels) under one location line."""
    insns, labels = sl.instructions(f'\t//## File "{K}", line {line}\n' + body)
    (loop,) = sl.loops(insns, labels, "kernel.py", {line}, names)
    return loop


def test_async_copies_stay_in_flight_until_their_wait():
    loop = only_loop("""
.L_x_5:
        /*0000*/                   LDGSTS.E.BYPASS.128 [R3], desc[UR4][R4.64] ;
        /*0010*/                   LDGSTS.E.BYPASS.128 [R3+0x10], desc[UR4][R6.64] ;
        /*0020*/                   LDGDEPBAR ;
        /*0030*/                   FFMA R20, R3, R8, R20 ;
        /*0040*/                   DEPBAR.LE SB0, 0x1 ;
        /*0050*/                   LDGSTS.E.BYPASS.128 [R3+0x20], desc[UR4][R6.64] ;
        /*0060*/              @!P0 BRA `(.L_x_5) ;
""", 553)
    assert loop.weight_bytes == 48 and loop.in_flight_bytes == 32
    assert loop.ahead == 1          # one commit group a trip, one left outstanding at the wait


def test_a_pipelined_loop_counts_the_trips_still_in_flight_at_its_wait():
    """A loop as Triton's pipeliner emits it with 4 stages: wait until at most 4 commit groups are
    outstanding (this trip's x and weights done; ptxas may name registers to wait for too, and
    a wait on another scoreboard is not a copy's), use the trip's tiles from shared memory, copy a
    later trip's x and weights (two groups): two later trips stream while one is used."""
    loop = only_loop("""
.L_x_6:
        /*0000*/                   DEPBAR.LE SB0, 0x4, {2,1} ;
        /*0008*/                   DEPBAR.LE SB1, 0x0 ;
        /*0010*/                   LDS.128 R8, [R3] ;
        /*0020*/                   FFMA R20, R8, R9, R20 ;
        /*0030*/                   LDGSTS.E [R5], desc[UR4][R10.64] ;
        /*0040*/                   LDGDEPBAR ;
        /*0050*/                   LDGSTS.E.BYPASS.128 [R3+0x800], desc[UR4][R6.64] ;
        /*0060*/                   LDGDEPBAR ;
        /*0070*/              @!P0 BRA `(.L_x_6) ;
""", 553)
    assert (loop.ahead, loop.shared) == (2, 1)
    # a loop of register loads has none
    assert only_loop("""
.L_x_7:
        /*0000*/                   LDG.E.128 R20, desc[UR4][R6.64] ;
        /*0010*/              @!P0 BRA `(.L_x_7) ;
""").ahead == 0


def test_a_wide_read_of_a_loaded_register_ends_what_is_in_flight():
    """STS.128 R12 reads R12..R15: the 8-byte load into R14 is used there, so the later load is
    not in flight with it."""
    loop = only_loop("""
.L_x_3:
        /*0000*/                   LDG.E.64 R14, desc[UR4][R4.64] ;
        /*0010*/                   STS.128 [R9], R12 ;
        /*0020*/                   LDG.E.128 R20, desc[UR4][R6.64] ;
        /*0030*/              @!P0 BRA `(.L_x_3) ;
""")
    assert (loop.weight_bytes, loop.in_flight_bytes) == (24, 8)


def test_a_loop_with_a_continue_is_one_loop_to_its_last_branch_back():
    loop = only_loop("""
.L_x_4:
        /*0000*/                   LDG.E.128 R20, desc[UR4][R6.64] ;
        /*0010*/               @P1 BRA `(.L_x_4) ;
        /*0020*/                   LDG.E.128 R24, desc[UR4][R6.64+0x10] ;
        /*0030*/              @!P0 BRA `(.L_x_4) ;
""")
    assert (loop.start, loop.end, loop.weight_bytes) == (0x0, 0x30, 32)


def test_without_inlining_records_a_loop_is_named_by_the_task_laid_out_after_it():
    """Triton 3.6's ptxas keeps only line numbers: the loop (lines of _linear_acc) is named by the
    nearest task function whose lines follow it."""
    listing = f"""
	//## File "{K}", line 10
        /*0000*/                   LDG.E.STRONG.GPU R2, desc[UR4][R40.64] ;
.L_x_6:
	//## File "{K}", line 449
        /*0010*/                   LDG.E.128 R20, desc[UR4][R6.64] ;
        /*0020*/              @!P0 BRA `(.L_x_6) ;
	//## File "{K}", line 35
        /*0030*/                   STG.E [R2.64], R20 ;
"""
    insns, labels = sl.instructions(listing)
    names = sl.enclosing_functions(["def _task_attn_partial():"] * 20 + ["def _task_linear():"] * 20
                                   + ["def _linear_acc():"] * 460)
    (loop,) = sl.loops(insns, labels, "kernel.py", {449}, names)
    assert loop.task == "_task_linear"


def test_the_dense_loop_of_a_build_is_its_linear_tasks_with_the_least_in_flight():
    loops = [dict(task="_task_moe_up", loads={"LDG.E.128": 1}, in_flight_bytes=16),
             dict(task="_task_linear", loads={"LDG.E.128": 8}, in_flight_bytes=128),
             dict(task="_task_linear_split", loads={"LDG.E.128": 8}, in_flight_bytes=96)]
    assert sl.dense_loop(loops)["in_flight_bytes"] == 96
    import pytest
    with pytest.raises(ValueError):
        sl.dense_loop(loops[:1])


def test_weight_sites_are_marked_lines_and_every_line_of_a_load_only_function():
    """A leaf function whose every load is a weight load lends all its lines (ptxas may record a
    load on a later line of it: Triton 3.9 put the FP8 expert loads three lines down); a function
    that also loads something else, or calls another (whose loads the text does not show), lends
    only its marked lines."""
    text = ["def _w_tile(w_ptr, w_off):", "    p = w_ptr", "    return tl.load(w_ptr + w_off)", "", "",
            "@triton.jit", "def _mixed(w_ptr, w_off, x_ptr):", "    w = tl.load(w_ptr + w_off)",
            "    x = tl.load(x_ptr)", "    return w * x", "", "def _none(x_ptr):", "    return tl.load(x_ptr)",
            "def _step(w_ptr, w_off, x_ptr):", "    x = _none(x_ptr)", "    return tl.load(w_ptr + w_off) * x"]
    sites = sl.load_sites(text, sl.WEIGHT_LOAD, sl.enclosing_functions(text))
    assert sites == {1, 2, 3, 4, 5, 6, 8, 16}
