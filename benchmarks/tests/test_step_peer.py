"""The peer's step beside ours (`python -m benchmarks.step_peer`): its rate read from its log, its
process handled, at toy size on the CPU."""
import pytest

from benchmarks import step_peer
from benchmarks.step_peer import finish_peer, peer_tokens_per_s, start_peer
from eagle3.bench import step


def test_the_peers_steady_state_rate_is_read_from_its_last_epoch():
    
    def epoch(n, *ms):   # the peer's log (speculators 0.9.0), one record per step
        return (f"[04:28:31] INFO     Training epoch {n}/2 started                    trainer.py:737\n"
                + "".join(f"                    profile/fwd_ms=398.646,\n                    profile/step_ms={t},"
                          f"\n                    lr=9.58e-05, global_step={i}\n" for i, t in enumerate(ms)))
    log = epoch(1, "2.41e+05", "1.10e+03") + epoch(2, "4.56e+03", "1.25e+03", "1.25e+03", "960.5") + "Epoch 2 100%"
    assert peer_tokens_per_s(log, 16384) == 16384 / 1.25         # the last epoch's median step
    assert peer_tokens_per_s(epoch(1, "500"), 100) == 200
    assert peer_tokens_per_s("rc 1 CUDA out of memory", 16384) is None


def test_the_peer_run_reads_the_full_log_its_script_writes(tmp_path, monkeypatch):
    script = tmp_path / "peer.py"   # writes its log as benchmarks/peer/speculators_step.py does, prints a summary
    script.write_text("import json, os, pathlib, sys\n"
                      "shape = json.loads(sys.argv[sys.argv.index('--shape') + 1])\n"
                      "pathlib.Path(os.environ['OUT'], 'peer_step.log').write_text("
                      "'Training epoch 2/2 started\\n profile/step_ms=2.00e+03,\\n profile/step_ms=1000.0,\\n"
                      " profile/step_ms=1.00e+03,\\n')\n"
                      "print('rc 0 5s', os.environ.get('CUDA_VISIBLE_DEVICES'), shape['hidden'])\n")
    monkeypatch.setenv("OUT", str(tmp_path))
    kimi, small = (step.SIZES[n]["seqs"] * step.SIZES[n]["seq_len"] for n in ("kimi", "small"))
    assert finish_peer(start_peer(str(script), None, "kimi"), "kimi") == kimi   # one 1-second step
    assert finish_peer(start_peer(str(script), 1, "small"), "small") == small   # --peer-gpu: beside ours, on GPU 1
    assert (tmp_path / "peer_step.out").read_text() == f"rc 0 5s 1 {step.SIZES['small']['hidden']}\n"
    assert (tmp_path / "peer_step-small.log").exists() and (tmp_path / "peer_step-kimi.log").exists()


@pytest.mark.parametrize("argv", [["--peer-gpu", "0"], ["--peer-gpu", "-1", "--peer-script", "peer.py"]])
def test_peer_gpu_names_another_gpu(argv, capsys):
    with pytest.raises(SystemExit):
        step_peer.main(["--tiny"] + argv)
    assert "--peer-gpu takes one size and names a GPU other than ours (0)" in capsys.readouterr().err


def test_a_failing_bench_stops_the_peer_running_beside_it(tmp_path, monkeypatch):
    script = tmp_path / "peer.py"
    script.write_text("import time\ntime.sleep(60)\n")
    started = []
    start = step_peer.start_peer
    monkeypatch.setattr(step_peer, "start_peer", lambda *a: started.append(start(*a)) or started[-1])
    monkeypatch.setattr(step, "run_ours", lambda *a: (_ for _ in ()).throw(RuntimeError("ours failed")))
    monkeypatch.setenv("OUT", str(tmp_path))
    with pytest.raises(RuntimeError, match="ours failed"):
        step_peer.main(["--tiny", "--dir", str(tmp_path / "bd"), "--peer-script", str(script), "--peer-gpu", "1"])
    assert started[0].process.wait(timeout=10) == -9   # killed, not left running for its minute
