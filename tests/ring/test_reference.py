import threading

import numpy as np
import pytest

from blink.errors import IllegalTransition
from blink.ring.control import ENGINE_STOPPED
from blink.ring.geometry import RingGeometry
from blink.ring.layout import FINISHED, FREE, RUNNING
from blink.ring.request import SamplingParams
from blink.ring.standin import standin_continuation

GEOMETRY = RingGeometry(n_slots=8, max_prompt_tokens=8, max_output_tokens=8, max_stop_ids=2)


def test_admission_is_fcfs_by_arrival_and_bounded_by_max_running(local_ring):
    memory, agent, consumer = local_ring(GEOMETRY, max_running=1)
    ids = [agent.submit([i + 1], SamplingParams(max_tokens=2, seed=i)) for i in range(5)]
    # Make arrival order differ from slot order: the last submitted arrived first.
    headers = consumer.view.headers
    headers["arrival_ns"][4] = headers["arrival_ns"][0] - 1
    order = []
    while agent.in_flight:
        consumer.step()
        running = np.flatnonzero(consumer.view.status["state"] == RUNNING).tolist()
        assert len(running) <= 1
        order += [s for s in running if s not in order]
        for out in agent.poll():
            if out.finished:
                assert out.new_tokens == standin_continuation([ids.index(out.request_id) + 1],
                                                              ids.index(out.request_id), 2)[-len(out.new_tokens):]
    assert order == [4, 0, 1, 2, 3]
    stats = agent.stats()
    assert stats["admitted"] == 5 and stats["finished"] == 5 and stats["tokens"] == 10


@pytest.mark.parametrize("field,value", [("prompt_len", 0), ("prompt_len", 9), ("max_tokens", 0),
                                         ("max_tokens", 9), ("n_stop", 3)])
def test_a_header_that_breaks_the_geometry_finishes_with_error(local_ring, field, value):
    memory, agent, consumer = local_ring(GEOMETRY)
    agent.submit([1, 2], SamplingParams(max_tokens=3))
    consumer.view.headers[field][0] = value        # as a buggy or hostile agent could write it
    consumer.step()
    (out,) = agent.poll()
    assert out.finished and out.finish_reason == "error" and out.new_tokens == []


def test_an_agent_writing_a_running_slot_is_an_illegal_transition(local_ring):
    memory, agent, consumer = local_ring(GEOMETRY)
    agent.submit([1], SamplingParams(max_tokens=5))
    consumer.step()
    assert consumer.view.status["state"][0] == RUNNING
    consumer.view.status["state"][0] = FREE         # an agent releasing a slot the GPU still owns
    held = r"slot 0 is RUNNING on the GPU side \(epoch 1, 1 generated\) but the ring shows FREE epoch 1"
    with pytest.raises(IllegalTransition, match=held):
        consumer.step()


def test_shutdown_aborts_everything_in_flight_and_reports_stopped(local_ring):
    memory, agent, consumer = local_ring(GEOMETRY, max_running=1)
    running = agent.submit([1], SamplingParams(max_tokens=8, ignore_eos=True))
    waiting = agent.submit([2], SamplingParams(max_tokens=8))
    consumer.step()
    agent.request_shutdown()
    thread = threading.Thread(target=consumer.run)
    thread.start()
    thread.join(10)
    assert not thread.is_alive()
    results = {out.request_id: out for out in agent.poll()}
    assert results[running].finish_reason == "abort" and results[waiting].finish_reason == "abort"
    assert results[running].new_tokens and not results[waiting].new_tokens
    assert agent.stats()["engine_state"] == ENGINE_STOPPED
    assert (consumer.view.status["state"] == FREE).all()


def test_outputs_are_written_before_their_count_and_state(local_ring):
    """Replays the consumer's writes one at a time: at no point does a published count cover an unwritten token."""
    memory, agent, consumer = local_ring(GEOMETRY)
    agent.submit([7], SamplingParams(max_tokens=4, seed=3))
    outputs = consumer.view.outputs
    outputs[0, :] = -1                              # poison
    expected = standin_continuation([7], 3, 4)
    for _ in range(4):
        consumer.step()
        n = int(consumer.view.status["n_generated"][0])
        assert outputs[0, :n].tolist() == expected[:n]
    assert consumer.view.status["state"][0] == FINISHED


def test_a_stale_cancel_word_never_aborts_the_slots_next_request():
    """Regression (1 wrong answer in a 10^5-request soak): the consumer read a slot's cancel and epoch words before
    its state word, so a request written into a slot whose previous request had been cancelled could be seen READY
    with the old epoch and aborted unasked. Readers load the announcing word (state) first."""
    from blink.nic.agent import Agent
    from blink.ring.reference import standin_engine

    geometry = RingGeometry(n_slots=1, max_prompt_tokens=4, max_output_tokens=4)
    with standin_engine(geometry) as (memory, _):
        agent = Agent.attach(memory)
        unasked = 0
        for _ in range(3000):
            cancelled = agent.submit([1], SamplingParams(max_tokens=4, seed=1))
            agent.cancel(cancelled)                    # leaves the slot's cancel word at this request's epoch
            reasons = {}
            while agent.in_flight:
                reasons.update({out.request_id: out.finish_reason for out in agent.poll() if out.finished})
            fresh = agent.submit([2], SamplingParams(max_tokens=1, seed=2))
            while agent.in_flight:
                reasons.update({out.request_id: out.finish_reason for out in agent.poll() if out.finished})
            unasked += reasons[fresh] == "abort"
    assert unasked == 0


def test_the_consumer_process_stops_when_its_parent_is_killed():
    """A stand-in engine whose parent (``blink serve --standin``, a soak) is killed stops by itself instead of
    spinning on an orphaned ring."""
    import signal
    import subprocess
    import sys
    import time

    code = ("from blink.ring.geometry import RingGeometry\n"
            "from blink.ring.reference import standin_engine\n"
            "import time\n"
            "if __name__ == '__main__':\n"
            "    with standin_engine(RingGeometry(n_slots=2, max_prompt_tokens=4, max_output_tokens=4)) as (m, p):\n"
            "        print(p.pid, flush=True)\n"
            "        time.sleep(60)\n")
    parent = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)
    consumer = int(parent.stdout.readline())
    parent.send_signal(signal.SIGKILL)
    parent.wait(10)
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        try:
            with open(f"/proc/{consumer}/stat") as f:
                if f.read().rsplit(")", 1)[1].split()[0] == "Z":
                    break
        except FileNotFoundError:
            break
        time.sleep(0.1)
    else:
        raise AssertionError(f"the consumer {consumer} still runs after its parent was killed")


def test_a_stand_in_engine_that_dies_at_start_is_reported_with_its_cause(tmp_path):
    """README's ring snippet saved as a script without ``if __name__ == "__main__":``: the spawned consumer imports
    the script again, which starts another engine during bootstrap, and dies. The parent says that it died and why,
    at once, instead of an agent's "unresponsive" after its liveness timeout."""
    import subprocess
    import sys

    script = tmp_path / "ring_script.py"
    script.write_text("from blink.nic.agent import Agent\n"
                      "from blink.ring.geometry import RingGeometry\n"
                      "from blink.ring.reference import standin_engine\n"
                      "geometry = RingGeometry(n_slots=4, max_prompt_tokens=8, max_output_tokens=8)\n"
                      "with standin_engine(geometry) as (memory, _):\n"
                      "    Agent.attach(memory)\n")
    done = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=300)
    assert done.returncode == 1
    last = done.stderr.strip().splitlines()[-1]
    assert "EngineUnresponsive: the stand-in engine process" in last and "exited with code 1" in last, done.stderr
    assert "if __name__ == \"__main__\":" in last, last


def test_requests_stepped_together_each_get_the_one_request_rules_answer():
    """The consumer steps its running requests at once (numpy over their slots). Over a small vocabulary, so that
    EOS and stop ids come up, each request's tokens, finish reason and logprobs are what the one-request rule gives
    (``expected_output``, ``standin_logprob`` one token at a time), whatever runs beside it."""
    from blink.nic.agent import Agent
    from blink.ring.layout import RingLayout
    from blink.ring.reference import ReferenceConsumer, expected_output
    from blink.ring.standin import standin_logprob
    from blink.ring.transport import LocalMemory

    geometry = RingGeometry(n_slots=32, max_prompt_tokens=8, max_output_tokens=16, max_stop_ids=2)
    layout = RingLayout(geometry)
    memory = LocalMemory(layout.size)
    layout.initialise(memory)
    consumer = ReferenceConsumer(layout.view(memory.buffer), eos_token_ids=(3,), max_running=24, vocab_size=7)
    agent = Agent.attach(memory)
    rng = np.random.default_rng(0)
    asked, answers = {}, {}
    for i in range(32):
        prompt = rng.integers(0, 7, rng.integers(1, 9)).tolist()
        params = SamplingParams(max_tokens=int(rng.integers(1, 17)), seed=i, ignore_eos=bool(i % 3 == 0),
                                stop_token_ids=[int(t) for t in rng.choice(7, i % 3, replace=False)],
                                logprobs=bool(i % 2))
        request_id = agent.submit(prompt, params)
        asked[request_id] = prompt, params
        answers[request_id] = [[], [], None]
    while agent.in_flight:
        consumer.step()
        for out in agent.poll():
            answer = answers[out.request_id]
            answer[0] += out.new_tokens
            answer[1] += out.new_logprobs or []
            answer[2] = out.finish_reason if out.finished else None
    for request_id, (prompt, params) in asked.items():
        tokens, reason = expected_output(prompt, params, eos_token_ids=(3,), vocab_size=7)
        history = prompt + tokens
        logprobs = [standin_logprob(history[p - 1], p, params.seed) for p in range(len(prompt), len(history))]
        assert answers[request_id] == [tokens, logprobs if params.logprobs else [], reason], request_id
    assert {reason for _, _, reason in answers.values()} == {"stop", "length"}
