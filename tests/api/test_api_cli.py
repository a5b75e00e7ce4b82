"""`reuse-server serve` flags: help text, flag -> EngineConfig, bad flags (exit 2) and load failures (exit 1)."""
import subprocess
import sys
from pathlib import Path

import pytest

from reuse_server.server.args import engine_config, parse_size
from reuse_server.server.cli import build_parser, main
from reuse_server.engine.config import EngineConfig

pytestmark = pytest.mark.server  # starts a server (or a subprocess that does)

REPO = Path(__file__).resolve().parents[2]
FLAGS = ["--model", "--served-model-name", "--host", "--port", "--device", "--dtype", "--weight-dtype", "--cpu-matmul",
         "--cpu-attention", "--attention-backend",
         "--block-size", "--num-gpu-blocks", "--kv-cache-memory", "--kv-cache-share", "--gpu-memory-utilization",
         "--cpu-cache-size", "--max-num-seqs", "--max-num-batched-tokens", "--max-model-len",
         "--max-tokens",
         "--no-prefix-cache", "--hash", "--eviction-policy", "--log-level", "--blend", "--no-blend",
         "--blend-recompute-ratio", "--blend-check-layers", "--blend-gradual-factors", "--blend-score",
         "--blend-first-tokens", "--blend-query-weight", "--blend-min-tokens", "--blend-separator", "--api-key",
         "--api-key-file", "--admin-api-key", "--max-waiting", "--request-timeout", "--step-timeout",
         "--shutdown-timeout", "--cuda-graphs"]


def test_help_documents_every_flag_with_its_default(capsys):
    with pytest.raises(SystemExit) as exit_:
        main(["serve", "--help"])
    assert exit_.value.code == 0
    text = " ".join(capsys.readouterr().out.split())
    for flag in FLAGS:
        assert flag in text, flag
    for shown in ["(default: smollm2)", "(default: 127.0.0.1)", "(default: 8000)", "(default: 16)",
                  "(default: auto)", "(default: 0.5)", "(default: 0.9)", "(default: xxh3_128)", "(default: lru)", "(default: 0)", "(default: info)",
                  "(default: off)", "(default: 0.15)", "(default: 1)", "(default: kv)", "(default: 32)",
                  "(default: none", "(default: native)", "(default: 256)", "(default: 30.0)", "(default: 60.0)",
                  "(default: none, the routes are open)"]:
        assert shown in text, shown
    assert text.count("(default") >= len(FLAGS) - 3  # --no-blend says "(the default)"; the key file and the
    # request timeout have none


def test_defaults_match_engine_config():
    assert engine_config(build_parser().parse_args(["serve"])) == EngineConfig(model="smollm2")


def test_kv_sizes_are_auto_unless_given():
    """auto (the default) reaches the engine as the AUTO type; a size, and 0 for the host tier, as bytes."""
    from reuse_server.kv.sizing import AUTO

    defaults = engine_config(build_parser().parse_args(["serve"]))
    assert defaults.kv_cache_memory is AUTO and defaults.cpu_cache_size is AUTO
    given = engine_config(build_parser().parse_args(["serve", "--kv-cache-memory", "2GiB", "--cpu-cache-size", "0",
                                                     "--kv-cache-share", "0.25", "--gpu-memory-utilization", "0.8"]))
    assert (given.kv_cache_memory, given.cpu_cache_size) == (2 << 30, 0)
    assert (given.kv_cache_share, given.gpu_memory_utilization) == (0.25, 0.8)
    assert engine_config(build_parser().parse_args(["serve", "--kv-cache-memory", "AUTO"])).kv_cache_memory is AUTO
    assert engine_config(build_parser().parse_args(["serve", "--cpu-cache-size", "4GB"])).cpu_cache_size == 4 * 10**9


def test_flags_reach_engine_config():
    args = build_parser().parse_args([
        "serve", "--model", "/m", "--served-model-name", "x", "claude-sonnet-4-5", "--device", "cuda:1", "--dtype", "bfloat16",
        "--cpu-matmul", "torch", "--cpu-attention", "torch", "--block-size", "32", "--num-gpu-blocks", "100", "--kv-cache-memory", "512MiB",
        "--max-num-seqs", "3",
        "--max-num-batched-tokens", "64", "--max-model-len", "128", "--max-tokens", "5", "--no-prefix-cache",
        "--hash", "sha256", "--eviction-policy", "lfu"])
    assert engine_config(args) == EngineConfig(
        model="/m", served_model_name=["x", "claude-sonnet-4-5"], max_tokens=5, device="cuda:1", dtype="bfloat16", cpu_matmul="torch", attention_backend="torch",
        block_size=32,
        num_gpu_blocks=100,
        kv_cache_memory=512 << 20, max_num_seqs=3, max_num_batched_tokens=64, max_model_len=128,
        enable_prefix_cache=False, hash_algo="sha256", eviction_policy="lfu")


def test_blend_flags_reach_engine_config():
    args = build_parser().parse_args([
        "serve", "--blend", "--blend-recompute-ratio", "0.3", "--blend-check-layers", "1,4,8",
        "--blend-gradual-factors", "3,2,1", "--blend-score", "v", "--blend-selection", "epic",
        "--blend-first-tokens", "2", "--blend-min-tokens", "8", "--blend-separator", "\n\n###\n\n"])
    assert engine_config(args) == EngineConfig(
        model="smollm2", enable_blend=True, blend_recompute_ratio=0.3, blend_check_layers=(1, 4, 8),
        blend_gradual_factors=(3.0, 2.0, 1.0), blend_score="v", blend_selection="epic", blend_first_tokens=2,
        blend_min_tokens=8,
        blend_separator="\n\n###\n\n")
    args = build_parser().parse_args(["serve", "--blend-query-weight", "1.5"])
    assert engine_config(args).blend_query_weight == 1.5 and engine_config(args).blend_selection == "cacheblend"
    assert engine_config(build_parser().parse_args(["serve", "--no-blend"])).enable_blend is False


@pytest.mark.parametrize("text, limit", [("auto", None), ("AUTO", None), ("0.25", 0.25), ("0", 0.0),
                                         ("inf", float("inf"))])
def test_blend_max_deviation_reaches_engine_config(text, limit):
    args = build_parser().parse_args(["serve", "--blend-max-deviation", text])
    assert engine_config(args).blend_max_deviation == limit
    assert engine_config(build_parser().parse_args(["serve"])).blend_max_deviation is None  # auto by default


@pytest.mark.parametrize("text, size", [("1GiB", 1 << 30), ("512MiB", 512 << 20), ("512mib", 512 << 20),
                                        ("2GB", 2 * 10**9), ("1.5GiB", 3 << 29), ("4096", 4096)])
def test_parse_size(text, size):
    assert parse_size(text) == size


@pytest.mark.parametrize("argv, needle", [
    (["--block-size", "3"], "power of two"),
    (["--block-size", "1024"], "power of two"),
    (["--block-size", "0"], "at least 1"),
    (["--kv-cache-memory", "lots"], "not a size"),
    (["--kv-cache-memory", "0"], "positive"),
    (["--kv-cache-memory", "automatic"], "not a size"),
    (["--cpu-cache-size", "lots"], "not a size"),
    (["--kv-cache-share", "0"], "not in (0, 1]"),
    (["--kv-cache-share", "1.5"], "not in (0, 1]"),
    (["--gpu-memory-utilization", "nan"], "not in (0, 1]"),
    (["--port", "70000"], "TCP port"),
    (["--hash", "md5"], "invalid choice"),
    (["--eviction-policy", "fifo"], "invalid choice"),
    (["--max-num-seqs", "x"], "not an integer"),
    (["--frobnicate"], "unrecognized arguments"),
    (["--blend-recompute-ratio", "1.5"], "not in [0, 1]"),
    (["--blend-recompute-ratio", "nan"], "not in [0, 1]"),
    (["--blend-check-layers", "0"], "start at 1"),
    (["--blend-check-layers", "2,1"], "strictly increasing"),
    (["--blend-check-layers", "1,x"], "comma-separated list"),
    (["--blend-gradual-factors", "1,2"], "non-increasing"),
    (["--blend-gradual-factors", "3,2"], "last factor must be 1"),
    (["--blend-check-layers", "1,2", "--blend-gradual-factors", "1"], "one factor per check layer"),
    (["--blend-score", "q"], "invalid choice"),
    (["--blend", "--no-blend"], "not allowed with"),
    (["--blend-first-tokens", "-1"], "must not be negative"),
    (["--blend-min-tokens", "0"], "at least 1"),
    (["--blend-query-weight", "-1"], "finite number >= 0"),
    (["--blend-query-weight", "inf"], "finite number >= 0"),
    (["--blend-selection", "sparse"], "invalid choice"),
    (["--blend-max-deviation", "-0.1"], "number >= 0 or inf"),
    (["--blend-max-deviation", "nan"], "number >= 0 or inf"),
    (["--blend-max-deviation", "lots"], "not a number"),
    (["--blend-first-tokens", "4"], "needs --blend-selection epic"),
    (["--blend-selection", "a3", "--blend-query-weight", "1"], "needs --blend-selection cacheblend"),
    (["--blend-separator", ""], "must not be empty"),
    (["--api-key", ""], "must not be empty"),
    (["--admin-api-key", " "], "must not be empty"),
    (["--api-key-file", "/no/such/keys.txt"], "could not read --api-key-file"),
    (["--max-waiting", "0"], "at least 1"),
    (["--max-tokens", "0"], "at least 1"),
    (["--served-model-name"], "expected at least one argument"),
    (["--served-model-name", "a", " "], "must not be empty"),
    (["--request-timeout", "0"], "> 0"),
    (["--shutdown-timeout", "-1"], ">= 0"),
    (["--step-timeout", "-1"], ">= 0"),
    (["--cuda-graphs"], "--cuda-graphs captures CUDA graphs of the decode step: it needs a CUDA device, not cpu"),
    (["--cuda-graphs", "--device", "cuda", "--attention-backend", "torch"], "cannot be captured"),
])
def test_bad_flags_exit_2_with_a_message(argv, needle, capsys):
    with pytest.raises(SystemExit) as exit_:
        main(["serve", *argv])
    assert exit_.value.code == 2
    err = capsys.readouterr().err
    assert needle in err and "Traceback" not in err


def test_a_key_file_without_keys_is_refused(tmp_path, capsys):
    """Starting open when keys were asked for would be worse than not starting."""
    empty = tmp_path / "keys.txt"
    empty.write_text("# nobody yet\n\n")
    with pytest.raises(SystemExit) as exit_:
        main(["serve", "--api-key-file", str(empty)])
    assert exit_.value.code == 2 and "holds no keys" in capsys.readouterr().err


def test_model_that_fails_to_load_exits_1_with_one_line(tmp_path):
    missing = tmp_path / "no-such-model"
    proc = subprocess.run([sys.executable, "-m", "reuse_server.server.cli", "serve", "--model", str(missing)],
                          cwd=REPO, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 1
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and "could not load the model" in lines[0] and str(missing) in lines[0]


def test_openmp_threads_get_a_short_spin_unless_the_user_chose():
    from reuse_server.server.openmp import apply_short_spin, with_short_spin

    assert with_short_spin({"PATH": "/bin"}) == {"PATH": "/bin", "GOMP_SPINCOUNT": "3000"}
    for own in ({"OMP_WAIT_POLICY": "PASSIVE"}, {"GOMP_SPINCOUNT": "0"}):
        assert with_short_spin(own) == own
    env = {"OMP_WAIT_POLICY": "ACTIVE"}
    apply_short_spin(env)
    assert env == {"OMP_WAIT_POLICY": "ACTIVE"}
    env = {}
    apply_short_spin(env)
    assert env == {"GOMP_SPINCOUNT": "3000"}


def test_launcher_reports_a_server_that_cannot_start(tmp_path):
    from reuse_server.server.launcher import ServerStartError, served

    log = tmp_path / "server.log"
    with pytest.raises(ServerStartError, match="exited with") as err:
        with served(["--model", str(tmp_path / "no-such-model")], log, startup_timeout=120):
            pass
    assert "no-such-model" in str(err.value)  # the log's tail comes with the error


def test_served_names_and_the_model_alias():
    """--model gemma3-270m serves the id gemma-3-270m and accepts the flag's own spelling; --served-model-name
    a b: a is the id, both are listed, and the --model value is still accepted (not listed)."""
    from reuse_server.engine.model_names import model_names

    bundled = model_names(engine_config(build_parser().parse_args(["serve", "--model", "gemma3-270m"])).model, None)
    assert bundled.id == "gemma-3-270m" and bundled.served == ("gemma-3-270m",)
    assert bundled.accepts("gemma3-270m") and not bundled.accepts("gemma3")
    config = engine_config(build_parser().parse_args(["serve", "--model", "/models/m.gguf", "--served-model-name",
                                                      "mine", "claude-sonnet-4-5", "mine"]))
    names = model_names(config.model, config.served_model_name)
    assert names.id == "mine" and names.served == ("mine", "claude-sonnet-4-5")  # a repeated name once
    assert names.accepts("/models/m.gguf") and not names.accepts("m") and not names.accepts("claude")
    assert model_names("/models/m.gguf", None).served == ("m",)
