"""`MultiHostEngine` in one process (an exchange with no other process): what it records for the followers, what it
refuses by name, and the command wire format (`pagedjax.engine.commands`). Two processes:
tests/parallel/test_multihost.py, tests/serve/test_serve_multihost.py."""

from __future__ import annotations

import json
import time

import pytest

from pagedjax import CacheConfig, LLMEngine, LoRARequest, SamplingParams
from pagedjax.cli import multihost as cli_multihost
from pagedjax.cli.errors import CLIError
from pagedjax.config import LoRAConfig
from pagedjax.engine.commands import Abort, Add, AddLoRA, Message, RemoveLoRA, WireError, decode, encode
from pagedjax.engine.multihost import (
    MultiHostEngine,
    RanksMismatchError,
    check_ranks_agree,
    describe,
    follow,
    state_digest,
)
from pagedjax.errors import EngineUnavailable, UnsupportedFeature
from pagedjax.parallel import distributed
from pagedjax.pooling_params import PoolingParams
from pagedjax.sampling_params import StructuredOutput
from pagedjax.serve.cli import build_parser as serve_parser
from tests.lora.adapters import write_adapter
from tests.serve.server_utils import CFG, make_engine

PROMPTS = [[256, 1, 2, 3], [256, *range(40, 60)]]
GREEDY = SamplingParams(temperature=0.0, max_tokens=6)


def test_commands_round_trip_and_bad_messages_are_named():
    message = Message("step", (
        Add("a", (1, 2), SamplingParams(temperature=1, top_p=0.5, stop=("x",), seed=3, logprobs=2,
                                        structured=StructuredOutput(choice=("y", "n"))), "salt",
            LoRARequest("l", 1, "/p"), None),
        Add("e", (3,), None, None, None, PoolingParams(normalize=True, dimensions=4)),
        Abort("b"), AddLoRA(LoRARequest("m", 2, "/q")), RemoveLoRA(2)))
    assert decode(encode(message)) == message
    for data, named in [(b'{"v":1,"op":"step","commands":[{"abort":{"request_id":1}}]}', "abort.request_id"),
                        (b'{"v":1,"op":"jump","commands":[]}', "op must be one of"),
                        (b'{"v":1,"op":"step","commands":[{"add":{"request_id":"a"}}]}', "add: missing"),
                        (b'{"v":1,"op":"step","commands":[],"x":1}', "unknown ['x']"),
                        (b'{"v":2,"op":"step","commands":[]}', "wire version 2"),
                        (b'{"v":true,"op":"step","commands":[]}', "wire version True"),
                        (b'{"v":1,"op":"step","commands":[{"rm":{}}]}', "a command is one of"),
                        (b'{"v":1,"op":"step","commands":[{"remove_lora":{"lora_int_id":0}}]}', None),
                        (b'\xff', "not a JSON message")]:
        if named is None:  # a value the command's own checks refuse (decoded, then refused where applied)
            assert decode(data).commands == (RemoveLoRA(0),)
            continue
        with pytest.raises(WireError, match=named.replace("[", r"\[").replace("]", r"\]")):
            decode(data)
    bad_params = (b'{"v":1,"op":"step","commands":[{"add":{"request_id":"a","prompt_token_ids":[1],'
                  b'"sampling_params":{"n":0},"cache_salt":null,"lora_request":null,"pooling":null}}]}')
    with pytest.raises(WireError, match="add.sampling_params: missing"):
        decode(bad_params)


@pytest.fixture
def leader():
    m = MultiHostEngine(make_engine(lora_config=LoRAConfig(max_loras=1, max_lora_rank=8)), heartbeat_s=0.2)
    yield m
    m.close()


def test_the_leader_generates_as_the_engine_and_records_each_change(leader, tmp_path):
    expected = make_engine().generate(PROMPTS, GREEDY, use_tqdm=False)
    assert [o.output_token_ids for o in leader.generate(PROMPTS, GREEDY)] == [o.output_token_ids for o in expected]
    before = leader.exchanges
    leader.add_request("r", PROMPTS[0], GREEDY, cache_salt="t")
    assert leader.abort("r") and not leader.abort("r")
    folder = write_adapter(tmp_path / "a", CFG, rank=4, seed=0)
    lora = LoRARequest("a", 1, str(folder))
    prepared = leader.make_request("s", PROMPTS[1], GREEDY, lora_request=lora)  # registers the adapter
    leader.add_prepared_request(prepared)
    pending = leader.pending_commands
    assert [type(c) for c in pending] == [Add, Abort, AddLoRA, Add]
    assert pending[0] == Add("r", tuple(PROMPTS[0]), pending[0].sampling_params, "t", None, None)
    assert pending[0].sampling_params.max_tokens == 6 and pending[3].lora_request == lora
    while leader.has_unfinished_requests():
        leader.step()
    assert leader.exchanges > before and leader.pending_commands == ()
    assert leader.remove_lora(1) and not leader.remove_lora(1)
    assert state_digest(leader.engine) == state_digest(make_engine())  # no request left: the empty state


def test_an_idle_leader_exchanges_heartbeats(leader):
    before = leader.exchanges
    time.sleep(0.8)
    assert leader.exchanges > before


def test_what_needs_each_process_s_own_inputs_is_refused_by_name(leader):
    with pytest.raises(UnsupportedFeature, match="no beam search"):
        leader.beam_search([PROMPTS[0]], None)
    with pytest.raises(AttributeError, match="MultiHostEngine has no 'update_weights'"):
        leader.update_weights  # noqa: B018
    with pytest.raises(ValueError, match="compiles nothing in the background"):
        leader.start_warmup()
    with pytest.raises(ValueError, match="compile_in_background=False"):
        MultiHostEngine(make_engine(compile_in_background=True))
    with pytest.raises(ValueError, match="follow\\(\\) runs on the others"):
        follow(make_engine())
    with pytest.raises(TypeError, match="one LLMEngine per process"):
        MultiHostEngine(object())
    with pytest.raises(ValueError, match="timeout_s and heartbeat_s must be > 0"):
        MultiHostEngine(make_engine(), timeout_s=0)


def test_a_closed_leader_refuses_every_change():
    m = MultiHostEngine(make_engine())
    m.close()
    m.close()  # idempotent
    with pytest.raises(EngineUnavailable, match="closed"):
        m.add_request("a", PROMPTS[0], GREEDY)
    with pytest.raises(EngineUnavailable, match="closed"):
        m.step()


def test_a_lost_process_is_raised_by_every_later_call_and_heard_once(monkeypatch):
    heard = []
    m = MultiHostEngine(make_engine(), on_lost=heard.append, heartbeat_s=60)
    m.add_request("a", PROMPTS[0], GREEDY)

    def gone(payload, digest):
        raise ValueError("UNKNOWN: Gloo AllGather failed: Connection closed by peer")

    monkeypatch.setattr("pagedjax.parallel.distributed.exchange", gone)
    with pytest.raises(EngineUnavailable, match="a process was lost .*Connection closed by peer"):
        m.step()
    for call in (lambda: m.step(), lambda: m.add_request("b", PROMPTS[0], GREEDY), lambda: m.abort("a")):
        with pytest.raises(EngineUnavailable, match="a process was lost"):
            call()
    assert len(heard) == 1 and "a process was lost" in str(heard[0])
    m.close()  # tells nobody (the exchange is gone), ends its threads


def test_a_stalled_process_is_lost_after_the_timeout(monkeypatch):
    m = MultiHostEngine(make_engine(), timeout_s=0.5, heartbeat_s=60)
    monkeypatch.setattr("pagedjax.parallel.distributed.exchange",
                        lambda payload, digest: (time.sleep(30), (payload, [digest]))[1])
    start = time.monotonic()
    with pytest.raises(EngineUnavailable, match="did not answer within 0.5 s"):
        m.step()
    assert time.monotonic() - start < 5


def test_a_differing_digest_stops_the_engine(monkeypatch):
    m = MultiHostEngine(make_engine(), heartbeat_s=60)
    monkeypatch.setattr("pagedjax.parallel.distributed.exchange", lambda payload, digest: (payload, [digest, 7]))
    with pytest.raises(EngineUnavailable, match=r"processes \[1\] hold another scheduler state"):
        m.step()


def test_a_disk_tier_is_refused(tmp_path):
    engine = LLMEngine(model_config=CFG, cache_config=CacheConfig(block_size=16, num_blocks=16,
                                                                  kv_host_memory_bytes=2**20,
                                                                  kv_disk_dir=str(tmp_path), kv_disk_bytes=2**20))
    with pytest.raises(ValueError, match="no disk KV tier"):
        MultiHostEngine(engine)


def test_processes_that_differ_are_refused_by_name(monkeypatch):
    """What every process compares at start (`describe`): a difference is named field by field, and both command
    lines refuse with it in one line. (Two real processes compare theirs in every two-process test's start-up.)"""
    mine = describe(make_engine(), {"flags": {"max_num_seqs": "8"}})
    other = json.loads(json.dumps(mine))
    other["config"]["scheduler_config"]["max_num_seqs"] = 9
    other["flags"]["max_num_seqs"] = "9"
    other["jax"] = "0.0.1"
    monkeypatch.setattr(distributed, "allgather_bytes", lambda data: [data, json.dumps(other).encode()])
    with pytest.raises(RanksMismatchError) as e:
        check_ranks_agree(mine)
    assert str(e.value).startswith("the processes do not run the same engine: process 1 differs from process 0 in "
                                   "3 fields: ")
    for field in ("config.scheduler_config.max_num_seqs: 16 (process 0) vs 9", "flags.max_num_seqs: 8 (process 0) vs 9",
                  f"jax: {mine['jax']} (process 0) vs 0.0.1"):
        assert field in str(e.value)
    monkeypatch.setattr(distributed, "allgather_bytes", lambda data: [data, b'{"jax": "0.0.1"}'])
    with pytest.raises(CLIError, match="process 1 differs from process 0 in .* fields: .*jax: "):
        cli_multihost.leader(make_engine(), serve_parser().parse_args([]))


@pytest.mark.parametrize("size", [0, 100, 8192 - 16, 8192 - 15, 20_000, 70_000])
def test_an_exchange_carries_any_payload_and_every_digest(size):
    payload = bytes(range(256)) * (size // 256) + bytes(size % 256)
    assert distributed.exchange(payload, 2**64 - 1) == (payload, [2**64 - 1])
    with pytest.raises(ValueError, match="digest must be a uint64"):
        distributed.exchange(payload, 2**64)
