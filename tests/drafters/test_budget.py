"""The draft budget follows the measured cost profile and the observed acceptance."""

from selfspec.core.cost import CostProfile
from selfspec.drafters.budget import ChainBudget
from selfspec.drafters.estimators import ConfidenceCalibration
from selfspec.drafters.prompt_lookup import lookup


def profile(ratios):
    return CostProfile(tuple(range(1, len(ratios) + 1)), tuple(0.1 * r for r in ratios), 256, "test")


def test_flat_profile_and_high_acceptance_drafts_long():
    b = ChainBudget(profile([1.0] * 16), k=10, prior_alpha=0.95)
    assert b.choose(room=100) == 10
    assert b.choose(room=3) == 3


def test_step_in_cost_limits_the_draft():
    # verifying up to 3 tokens is nearly free, 4 or more costs twice as much
    b = ChainBudget(profile([1.0, 1.05, 1.08] + [2.0] * 13), k=10, prior_alpha=0.6)
    assert b.choose(room=100) == 2


def test_low_acceptance_stops_drafting_but_probes():
    b = ChainBudget(profile([1.0, 1.5, 2.0, 2.5]), k=3, prior_alpha=0.6, probe_every=4)
    for _ in range(20):
        b.update(proposed=2, accepted=0)
    assert b.alpha < 0.1
    picks = [b.choose(room=10) for _ in range(28)]
    # probes after 4, then 8, then 16 more steps: the interval doubles while drafting does not pay
    assert [i for i, k in enumerate(picks) if k] == [3, 11, 27] and set(picks) == {0, 1}


def test_in_a_batch_a_request_probes_width_times_less_often():
    """A probe draft stalls every request of the packed forward, so a request in a batch of 4
    probes a quarter as often as alone: the batch as a whole probes as often as one request."""
    b = ChainBudget(profile([1.0, 1.5, 2.0, 2.5]), k=3, prior_alpha=0.6, probe_every=4)
    for _ in range(20):
        b.update(proposed=2, accepted=0)
    b.width = 4
    picks = [b.choose(room=10) for _ in range(112)]
    assert [i for i, k in enumerate(picks) if k] == [15, 47, 111]  # 4 x (4, 8, 16) steps apart
    b.width = 1
    assert [b.choose(room=10) for _ in range(32)].count(0) == 31  # alone: the interval (now 32) is its own


def test_expensive_draft_shortens_chain():
    b = ChainBudget(profile([1.0] * 16), k=10, prior_alpha=0.8)
    cheap = b.choose(room=100)
    b.update(proposed=1, accepted=1, draft_seconds=0.05)  # half of T(1) per drafted token
    assert b.choose(room=100) < cheap


def test_a_batch_sizes_drafts_against_the_batchs_cost():
    """T(q) flat up to 8 rows, then one T(1) more per 8 rows (weights-bound, then compute-bound):
    alone a request drafts 7 (8 rows cost what 1 does); with 2 requests in the forward 3 (their 8
    rows are the flat part); with 8, every extra row costs compute and a plain batched step pays
    best (a probe now and then, as when drafting does not pay alone)."""
    b = ChainBudget(profile([1.0] * 8 + [1.0 + (q - 8) / 8 for q in range(9, 97)]), k=8, prior_alpha=0.7)
    assert b.choose(room=100) == 7
    b.width = 2
    assert b.choose(room=100) == 3
    b.width = 8
    assert [b.choose(room=100) for _ in range(3)] == [0, 0, 0]
    b.width = 1
    assert b.choose(room=100) == 7


def test_shared_cost_is_the_batchs_step_over_its_plain_step():
    p = CostProfile((1, 2, 4, 8), (1.0, 1.0, 2.0, 4.0), 256, "k")
    assert p.shared(3) == p.ratio(3) == 1.5
    assert p.shared(2, 2) == p.ratio(4) / p.ratio(2) == 2.0
    assert p.shared(1, 4) == 1.0  # one row each: the batch's plain step


def test_fixed_k_without_profile():
    assert ChainBudget(None, k=4).choose(room=10) == 4
    assert ChainBudget(None, k=4).choose(room=2) == 2


def test_cost_profile_interpolates_and_extrapolates():
    p = CostProfile((1, 2, 4), (1.0, 1.0, 3.0), 256, "k")
    assert p.ratio(3) == 2.0
    assert p.ratio(6) == 5.0


def test_prompt_lookup_finds_latest_longest_match():
    ids = [1, 2, 3, 9, 1, 2, 3, 7, 8, 5, 2, 3]
    assert lookup(ids, 3, 1, 3) == [7, 8, 5]  # "2 3" most recently followed by 7 8 5
    assert lookup([1, 2, 3], 3, 1, 2) == []
    assert lookup([4, 5, 4], 2, 1, 5) == [5, 4]


def test_best_prefix_skips_expensive_block_sizes():
    # q = 2 and 3 cost 2x and 3x, q = 4 only 1.5x (the shape measured on our AMD machine)
    b = ChainBudget(profile([1.0, 2.0, 3.0, 1.5, 1.6]), k=4)
    assert b.best_prefix([0.95, 0.95, 0.95]) == 3
    assert b.best_prefix([0.95, 0.2, 0.9]) == 3  # q = 4 is cheaper than q = 2
    assert b.best_prefix([0.3, 0.2, 0.1]) == 0
    assert ChainBudget(None, k=4).best_prefix([0.1, 0.1]) == 2


def test_confidence_calibration_starts_at_identity_and_learns():
    c = ConfidenceCalibration()
    assert abs(c(0.25) - 0.25) < 1e-9 and abs(c(0.97) - 0.97) < 1e-9 and abs(c(1.0) - 1.0) < 1e-9
    for _ in range(60):  # a near copy of the target: drafts of confidence 0.2-0.3 are always accepted
        c.observe([0.25, 0.95], verified=2, accepted=2)
    assert c(0.22) > 0.85 and c(0.25) > 0.95  # within the decile, in proportion to confidence
    assert abs(c(0.55) - 0.55) < 1e-9  # unobserved deciles keep their prior


def test_confidence_calibration_observes_only_up_to_the_first_rejection():
    c = ConfidenceCalibration()
    for _ in range(60):
        c.observe([0.95, 0.45, 0.15], verified=3, accepted=1)  # the second draft rejected
    assert c(0.95) > 0.9 and c(0.45) < 0.1
    assert abs(c(0.15) - 0.15) < 1e-9  # after the rejection: never tested on its own
    c2 = ConfidenceCalibration()
    c2.observe([0.15, 0.15], verified=1, accepted=1)  # a prefix verified: the unverified draft is not seen
    c3 = ConfidenceCalibration()
    c3.observe_one(0.15, True)
    assert c2(0.15) > 0.15 and (c2.hits, c2.mass) == (c3.hits, c3.mass)


def test_confidence_calibration_scales_within_a_decile():
    """A decile's estimate is a ratio: drafts far below the ones that were verified are not given
    their acceptance (EAGLE tree tails of path probability 0.001 are not worth 0.04 each)."""
    c = ConfidenceCalibration()
    for _ in range(200):  # drafts near 0.09 accepted 4 times in 10
        c.observe_one(0.09, _ % 10 < 4)
    assert abs(c(0.09) - 0.4) < 0.05
    assert c(0.001) < 0.005 and c(0.045) < 0.21
    for _ in range(200):  # a near copy: drafts of confidence 0.25 always accepted
        c.observe_one(0.25, True)
    assert c(0.25) > 0.95 and c(0.29) == 1.0  # capped at 1
    assert c.ratio(2) <= 1 / 0.25


def test_best_prefix_trusts_a_draft_whose_low_confidences_are_accepted():
    b = ChainBudget(profile([1.0, 1.5, 1.8, 2.1, 2.4]), k=4)
    assert b.best_prefix([0.3, 0.25, 0.3]) == 0  # at face value, verifying them does not pay
    for _ in range(60):
        b.update(proposed=3, accepted=3, confidences=[0.3, 0.25, 0.3])
    assert b.best_prefix([0.3, 0.25, 0.3]) == 3
