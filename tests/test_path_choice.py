"""PathChoice (Note [Which path a step takes] in prefetch/offload/path_choice.py): a
step's path from what the last step missed, and the hold after failed
sync-free tries."""
from prefetch.sync_free import _FIRST_HOLD, _MAX_HOLD, _TRY_STEPS, PathChoice

LOW, HIGH = 0.01, 0.30  # under 3 % and over 10 % of the routed experts


def run(choice, misses_of):
    """Steps the choice: misses_of(sync_free) is what a step on that path
    missed. Returns the path of each step."""
    paths = []
    for _ in range(200):
        sync_free = choice.sync_free
        paths.append(sync_free)
        choice.after(misses_of(sync_free))
    return paths


def starts(paths):
    """The steps at which a sync-free run began after a synced step."""
    return [i for i in range(1, len(paths)) if paths[i] and not paths[i - 1]]


def test_a_cache_that_holds_the_steps_reads_stays_sync_free():
    choice = PathChoice()
    assert all(run(choice, lambda sync_free: LOW))
    assert choice.switches == 0 and choice.held == 0


def test_many_misses_on_every_path_stay_synced():
    choice = PathChoice()
    paths = run(choice, lambda sync_free: HIGH)
    assert paths[0] and not any(paths[1:])
    assert choice.switches == 1 and choice.held == 0


def test_the_first_run_is_no_try():
    # A cold cache misses on the first steps whatever the path: the first
    # synced step that misses little switches back at once.
    choice = PathChoice()
    assert choice.after(HIGH) is False
    assert choice.after(LOW) is True
    assert choice.held == 0


def test_failed_tries_are_held_off_longer_each_time():
    # The oracle with a cache smaller than a step's reads: synced steps miss
    # little, sync-free ones a lot. Without the hold the path flipped every
    # step (100 sync-free steps of 200); with it each failed try waits twice
    # as long as the last, up to _MAX_HOLD.
    choice = PathChoice()
    paths = run(choice, lambda sync_free: HIGH if sync_free else LOW)
    tries = starts(paths)
    gaps = [b - a for a, b in zip(tries, tries[1:])]
    holds = [_FIRST_HOLD * 2 ** i for i in range(len(gaps))]
    # A try is one sync-free step, then one synced step whose low misses
    # would switch back, then the hold.
    assert gaps == [2 + min(h, _MAX_HOLD) for h in holds]
    assert sum(paths) == len(tries) + 1  # each try one step, and the first run
    assert sum(paths) <= 8
    assert choice.held >= sum(min(h, _MAX_HOLD) for h in holds)  # every hold waited out


def test_a_run_that_lasts_clears_the_hold():
    choice = PathChoice()
    choice.after(HIGH)  # the first run ends
    assert choice.after(LOW) is True  # a try
    for hold in (_FIRST_HOLD, 2 * _FIRST_HOLD, 4 * _FIRST_HOLD):  # three failed tries in a row
        assert choice.after(HIGH) is False
        held = choice.held
        while not choice.after(LOW):  # the hold, then the next try
            pass
        assert choice.held - held == hold
    for _ in range(_TRY_STEPS):  # this try holds
        assert choice.after(LOW) is True
    assert choice.after(HIGH) is False  # it ends, but it was no failed try: no hold
    assert choice.after(LOW) is True
    assert choice.after(HIGH) is False  # a failed try: the hold starts over
    held = choice.held
    while not choice.after(LOW):
        pass
    assert choice.held - held == _FIRST_HOLD


def test_only_steps_that_would_switch_count_against_the_hold():
    choice = PathChoice()
    choice.after(HIGH)
    choice.after(LOW)  # a try
    choice.after(HIGH)  # failed: hold _FIRST_HOLD
    for _ in range(10):  # synced steps that miss a lot wait without using the hold up
        assert choice.after(HIGH) is False
    assert choice.held == 0
    for _ in range(_FIRST_HOLD):
        assert choice.after(LOW) is False
    assert choice.after(LOW) is True
    assert choice.held == _FIRST_HOLD


def test_an_unknown_step_changes_nothing():
    choice = PathChoice()
    choice.after(HIGH)
    assert choice.after(None) is False
    choice.after(LOW)
    assert choice.after(None) is True
    assert choice.switches == 2


def test_misses_of_experts_never_read_before_fail_no_try():
    # A cache still warming: the sync-free step missed experts no step had
    # read (no path avoids those), so the next low-miss synced step goes
    # back at once; misses of experts read before do fail it.
    choice = PathChoice()
    choice.after(HIGH)  # the first run ends
    assert choice.after(LOW) is True  # a try
    assert choice.after(HIGH, missed_again=0.0) is False
    assert choice.after(LOW) is True  # no hold
    assert choice.after(HIGH, missed_again=HIGH) is False
    assert choice.after(LOW) is False  # held
    assert choice.held == 1
