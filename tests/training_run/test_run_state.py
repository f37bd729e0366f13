"""The run's state machine: one table, every state reachable, close always leads to the end, and
waits wake on every move."""

from __future__ import annotations

import threading
import time

from otel_forge.mlflow.training.run_state import TRANSITIONS, RunEvent, RunState, RunStateMachine


def _reachable(start: RunState) -> set[RunState]:
    seen, todo = {start}, [start]
    while todo:
        for after in TRANSITIONS[todo.pop()].values():
            if after not in seen:
                seen.add(after)
                todo.append(after)
    return seen


def test_every_state_is_reachable_and_close_ends_the_run_from_anywhere() -> None:
    assert set(TRANSITIONS) == set(RunState)
    assert _reachable(RunState.IDLE) == set(RunState)
    for state in RunState:
        machine = RunStateMachine()
        machine._state = state
        for event in (RunEvent.CLOSE, RunEvent.LEAVE, RunEvent.CLOSED):  # what close() fires, in order
            machine.fire(event)
        assert machine.state is RunState.ENDED, state
    assert TRANSITIONS[RunState.ENDED] == {}  # nothing moves an ended run: a late answer, a second close


def test_an_event_a_state_has_no_row_for_leaves_it_as_it_is() -> None:
    machine = RunStateMachine()
    for event in (RunEvent.BEGIN, RunEvent.UNANSWERED, RunEvent.ANSWERED, RunEvent.OPENED):
        machine.fire(event)
    assert machine.state is RunState.OPEN
    assert machine.fire(RunEvent.REFUSED) is RunState.OPEN and machine.state is RunState.OPEN
    machine.fire(RunEvent.CLOSE)
    machine.fire(RunEvent.OPENED)  # the opener answered during close's drain: close still ends it
    assert machine.state is RunState.CLOSING and machine.closed and not machine.left


def test_close_waits_for_an_opener_that_is_asking_but_not_for_a_server_that_does_not_answer() -> None:
    asking, down = RunStateMachine(), RunStateMachine()
    for machine in (asking, down):
        machine.fire(RunEvent.BEGIN)
    down.fire(RunEvent.UNANSWERED)
    for machine in (asking, down):
        machine.fire(RunEvent.CLOSE)
    assert asking.state is RunState.CLOSING and not asking.left  # its waits go on, within the drain deadline
    assert down.state is RunState.LEFT and down.pause(30)  # its backoff ends at once: one last attempt


def test_a_pause_ends_when_rank_zero_is_known_and_when_the_opener_is_left() -> None:
    machine = RunStateMachine()
    machine.fire(RunEvent.BEGIN)
    woken: list[bool] = []
    waiter = threading.Thread(target=lambda: woken.append(machine.pause(30)))
    waiter.start()
    time.sleep(0.05)
    machine.fire(RunEvent.RANK_ZERO)  # no move of state, yet the waiter looks again
    waiter.join(5)
    assert woken == [True] and machine.state is RunState.OPENING
    machine.fire(RunEvent.CLOSE)
    assert machine.pause(0.05) is False  # closing: a rank still looks for rank 0's run, within the drain
    machine.fire(RunEvent.LEAVE)
    assert machine.pause(30) is True  # the opener is left: no wait at all
    assert RunStateMachine().pause(0.01) is False


def test_waiting_for_the_answer_ends_when_the_server_is_down_and_counts_from_the_first_ask() -> None:
    machine = RunStateMachine()
    machine.fire(RunEvent.BEGIN)
    threading.Timer(0.05, machine.fire, (RunEvent.UNANSWERED,)).start()
    assert machine.wait_answer(30) is True and machine.state is RunState.UNANSWERED
    late = RunStateMachine()
    late.fire(RunEvent.BEGIN)
    late.asked()
    assert late.wait_answer(0.05) is False and late.state is RunState.OPENING
