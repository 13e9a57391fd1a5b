"""The step width chooser (runtime/draft_length.py), pure Python: its acceptance estimate against hand counts, a
fixed gamma honoured exactly, probes while plain decoding, and its speed at scripted acceptance (tools/scripted.py)
over step-cost tables shaped like the measured ones: never below plain with a drafter that is never right, within
3% of the best fixed width at a stationary acceptance, and >= 10% above the best fixed width when acceptance comes
in phases."""
import pytest

from dflash_trt.abi import DEFAULT_KS
from dflash_trt.runtime.draft_length import (AUTO, Acceptance, CostModel, CostTable, DraftLength, GammaError,
                                             check_gamma, expected_tokens)
from dflash_trt.tools.scripted import bench_scripted, fixed_and_auto, print_scripted, simulate

# step ms per width at one batch bucket: an MoE target at batch 1 (experts touched grow with the rows), a dense one at
# batch 1 (memory bound: wide steps nearly free), both at batch 16 (compute starts to show)
TABLES = {
    "moe b1": (1, {1: 0.864, 2: 1.10, 3: 1.30, 4: 1.50, 8: 2.20, 16: 2.995}),
    "dense b1": (1, {1: 1.00, 2: 1.12, 3: 1.13, 4: 1.14, 8: 1.18, 16: 1.30}),
    "dense b16": (16, {1: 1.30, 2: 1.60, 3: 1.80, 4: 2.00, 8: 2.80, 16: 4.20}),
    "moe b16": (16, {1: 2.00, 2: 2.60, 3: 3.00, 4: 3.40, 8: 4.50, 16: 6.50}),
}
TOKENS = 4096


def costs(name):
    bucket, ms = TABLES[name]
    return bucket, CostTable({(k, bucket): v for k, v in ms.items()})


@pytest.mark.parametrize("name", sorted(TABLES))
def test_auto_against_fixed_widths_at_scripted_acceptance(name):
    bucket, table = costs(name)
    rnd = fixed_and_auto(DEFAULT_KS, table, "random", TOKENS, bucket)
    assert rnd["best"] == "K=1" and rnd["auto"] >= 0.97 * rnd["K=1"], rnd
    st = fixed_and_auto(DEFAULT_KS, table, "stationary", TOKENS, bucket)
    assert st["auto"] >= 0.97 * st[st["best"]], st
    ph = fixed_and_auto(DEFAULT_KS, table, "phased", TOKENS, bucket)
    assert ph["auto"] >= 1.10 * ph[ph["best"]], ph


def test_without_probes_a_return_of_acceptance_is_missed():
    """The phased check needs the probes: with none (budget 0 -> never), auto stays at plain after the first
    phase without acceptance and falls behind."""
    bucket, table = costs("dense b1")
    probing = simulate(DraftLength(DEFAULT_KS, table), table, "phased", TOKENS, bucket)
    never = DraftLength(DEFAULT_KS, table, probe_budget=1e-12)
    assert simulate(never, table, "phased", TOKENS, bucket) < 0.8 * probing


def test_acceptance_counts_positions_up_to_the_first_rejection():
    acc = Acceptance(4, discount=0.5, prior=(0.5, 1.0))
    acc.record(3, [2, 0, 3])  # rows: drafts 1-2 then a reject; a reject at 1; all 3 accepted
    # position 1: 3 trials, 2 hits; position 2: 2 trials, 2 hits; position 3: 2 trials, 1 hit; position 4: unseen
    assert acc.trials == [0.5 + 3, 0.5 + 2, 0.5 + 2, 1.0]
    assert acc.hits == [0.25 + 2, 0.25 + 2, 0.25 + 1, 0.5]
    assert expected_tokens([1.0, 0.5, 0.5], 4) == 1 + 1 + 0.5 + 0.25
    assert expected_tokens([0.9, 0.9], 1) == 1


def test_fixed_width_is_honoured_and_auto_needs_plain_decode():
    fixed = DraftLength([1, 16], CostModel(), fixed=4)
    for _ in range(50):
        assert fixed.choose(1) == 4
        fixed.record(4, [0])
    assert fixed.widest == 4
    with pytest.raises(ValueError, match="width 1"):
        DraftLength([4, 8], CostModel())


def test_plain_decode_is_probed_within_its_budget():
    table = CostTable({(1, 1): 1.0, (2, 1): 1.05, (16, 1): 3.0})
    dl = DraftLength([1, 2, 16], table)
    widths = []
    for _ in range(200):
        K = dl.choose(1)
        widths.append(K)
        dl.record(K, [0])  # never right
    plain = widths[20:]
    assert set(plain) == {1, 2} and 1 / 6 <= plain.count(2) / len(plain) <= 0.2  # interval 5: 5 plain, one probe
    assert dl.probe_interval(1, 1) == 5


def test_cost_table_and_gamma_refusals():
    with pytest.raises(ValueError, match="positive"):
        CostTable({(1, 1): 0.0})
    with pytest.raises(KeyError, match="width 8"):
        CostTable({(1, 1): 1.0}).seconds(8, 1)
    assert CostTable({(4, 1): 1.0, (4, 16): 3.0}).seconds(4, 12) == 3.0  # the nearest bucket measured
    assert check_gamma(AUTO, 16) is None and check_gamma(None, 16) is None and check_gamma(15, 16) == 15
    for bad in (0, 16, 2.0, "7", True):
        with pytest.raises(GammaError):
            check_gamma(bad, 16)


def test_bench_lines_from_measured_steps(capsys):
    """The benches' scripted lines: the measured step(K) + the spec step's drafter time as the cost table, one line
    per script and the three checks in the bench's targets; skipped in a line when gamma + 1 was not measured."""
    ms = TABLES["moe b1"][1]
    res = {"steps": {k: {"ms": v - (0.2 if k > 1 else 0.0)} for k, v in ms.items()},
           "decode": {"gamma": 15, "plain_step_ms": ms[1], "spec_step_ms": ms[16]}, "targets": {"other": (1, 1, True)}}
    bench_scripted(res)
    assert res["scripted"]["rows"]["stationary"]["K=1"] == pytest.approx(1e3 / ms[1])  # tok/s: one token a step
    assert [k for k in res["targets"] if k.startswith("batch 1 auto K")]
    assert all(hit for _, _, hit in res["targets"].values())
    print_scripted(res["scripted"])
    out = capsys.readouterr().out.splitlines()
    assert [line.split(" (")[0] for line in out] == ["scripted random", "scripted stationary", "scripted phased"]
    res = {"steps": {1: {"ms": 1.0}, 16: {"ms": 2.0}}, "decode": {"gamma": 7, "plain_step_ms": 1, "spec_step_ms": 2}}
    bench_scripted(res)
    assert "targets" not in res and "K = gamma + 1 = 8" in res["scripted"]["skipped"]


def test_acceptance_weighed_from_the_choice_after_next():
    """An executor that keeps a step in flight chooses step s + 1 before step s lands: every executor weighs step s
    from choice s + 2, so their choices agree."""
    dl = DraftLength([1, 4], CostModel())
    assert dl.choose(1) == 4  # step 0
    dl.record(4, [3], step=0)
    before = dl.acceptance.rates()
    dl.choose(1)  # step 1
    assert dl.acceptance.rates() == before
    dl.choose(1)  # step 2
    assert dl.acceptance.rates()[:3] > before[:3]
