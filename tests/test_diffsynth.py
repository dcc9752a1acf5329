"""``--format diffsynth``: every file holds what DiffSynth-Studio's own ``--task sft:data_process`` would save for
the sample, computed here by the released ``diffsynth`` 2.1.12 package itself on the CPU (`tests.diffsynth_ref`: its
pipeline units, VAE, UMT5, tokenizer and CLIP code with the tiny snapshot's weights), and its own loader and training
step (``UnifiedDataset`` over the cache, ``LoadTorchPickle``, ``FlowMatchSFTLoss`` through a ``WanModel``) take every
file. latentforge reads the files with ``weights_only=True`` only.

The clip is a 96x64 centre crop of a real one (small and quick; sides the Wan2.2 VAE's 16 and the DiT's 2x2 patches
divide): DiffSynth's crop-and-resize at that size is the identity, so the frames both sides encode are the same and
only the encoders' arithmetic differs (diffusers' and transformers' classes here, DiffSynth's own there): within a
few bf16 steps.
"""

from __future__ import annotations

import io
import shutil
from pathlib import Path

import av
import pytest
import torch
from PIL import Image
from typer.testing import CliRunner

from flows.cli import app
from flows.terminal_run import run_build
from infra.audit.decode_verify import decode_and_verify
from infra.formats import get_format
from infra.gates.verify import verify_out
from infra.plan import make_spec
from tests import diffsynth_ref as ds
from tests.conftest import config, make_shards, sample, tree_hashes
from tests.media_utils import cut_clip

runner = CliRunner()
FRAMES, HEIGHT, WIDTH = 17, 64, 96
GEOMETRY = {"recipe": "diffsynth-wan", "frames": FRAMES, "height": HEIGHT, "width": WIDTH}
PROMPTS = ("A man  talks &amp; smiles in a car.", "Cyclists ride past a grey van.")
#: What its data_process saves that the files leave out: PIL images, random noise, the device's name.
LEFT_OUT = {"input_video", "input_image", "noise", "latents", "rand_device"}


@pytest.fixture(scope="module")
def videos(clips) -> list[bytes]:
    return [cut_clip(clips[name], FRAMES, crop=(HEIGHT, WIDTH)) for name in ("carphone", "bikes")]


@pytest.fixture(scope="module")
def source(videos, tmp_path_factory) -> Path:
    made = [sample(i, i, video, prompt.encode()) for i, (video, prompt) in enumerate(zip(videos, PROMPTS, strict=True))]
    return make_shards(tmp_path_factory.mktemp("diffsynth-src"), {"shard-0": made})


@pytest.fixture(scope="module")
def t2v_build(source, wan21_model, tmp_path_factory) -> tuple[Path, dict]:
    """One Wan2.1-T2V build of the module's clips and its result: the tests that read it share it, a test that
    changes it works on a copy."""
    out = tmp_path_factory.mktemp("diffsynth-t2v") / "out"
    ok, result = run_build(config(source, wan21_model, out, **GEOMETRY))
    assert ok and result["done"] == 2, result
    return out, result


def _frames(video: bytes) -> list[Image.Image]:
    """The clip's frames as its video loader hands them on (PIL, through its own ImageCropAndResize)."""
    with av.open(io.BytesIO(video)) as container:
        frames = [Image.fromarray(f.to_ndarray(format="rgb24")) for f in container.decode(video=0)][:FRAMES]
    return ds.crop_resize(frames, HEIGHT, WIDTH)


def _bf16_close(ours: torch.Tensor, theirs: torch.Tensor, steps: float = 4.0) -> None:
    """Within `steps` bf16 steps of its value (at least of 2^-10: values near zero)."""
    assert ours.shape == theirs.shape and ours.dtype == torch.bfloat16, (ours.shape, theirs.shape, ours.dtype)
    step = torch.exp2(torch.floor(torch.log2(theirs.abs().clamp_min(2**-10))) - 7)
    worst = ((ours.float() - theirs.float()).abs() / step).max().item()
    assert worst <= steps, f"differs by {worst:.1f} bf16 steps"


def _file(out: Path, index: int) -> Path:
    item = sample(index, index, None, None)
    return out / item.generator / f"{item.task}_{index:08d}.pth"


def _check_against_its_data_process(out: Path, snapshot: Path, videos: list[bytes], image: bool, fused: bool) -> None:
    pipe = ds.pipeline(snapshot, image=image, fused=fused)
    for index, (video, prompt) in enumerate(zip(videos, PROMPTS, strict=True)):
        ours = torch.load(_file(out, index), weights_only=True)  # what latentforge reads: no pickled code
        theirs = ds.data_process(pipe, _frames(video), prompt, image)
        assert set(ours[0]) == set(theirs[0]) - LEFT_OUT | {"latentforge"}
        for key, value in theirs[0].items():
            if key in LEFT_OUT:
                continue
            if isinstance(value, torch.Tensor):
                _bf16_close(ours[0][key], value)
            else:
                assert ours[0][key] == value, key
        if "y" in theirs[0]:  # the mask channels: exactly its own
            assert torch.equal(ours[0]["y"][:, :4].float(), theirs[0]["y"][:, :4])
        assert ours[1]["prompt"] == theirs[1]["prompt"] == prompt
        seq_len = int(theirs[1]["context"][0].abs().sum(dim=1).gt(0).sum())
        assert 1 < seq_len < 512 and not ours[1]["context"][0, seq_len:].any()  # zero past the prompt, as its own
        _bf16_close(ours[1]["context"][:, :seq_len], theirs[1]["context"][:, :seq_len])
        assert set(ours[2]) == set(theirs[2]) == {"context"} and torch.equal(ours[2]["context"], ours[1]["context"])
    dataset = ds.diffsynth().unified_dataset.UnifiedDataset(base_path=str(out), metadata_path=None)  # its own reader
    assert len(dataset.cached_data) == len(videos)
    for path in dataset.cached_data:  # its trainer's own load (weights_only=False) and training step
        loss = ds.train_step(pipe, ds.diffsynth().operators.LoadTorchPickle()(path))
        assert torch.isfinite(loss)


def test_wan21_i2v_files_are_what_diffsynths_own_data_process_saves(tmp_path, source, videos, wan21_i2v_model):
    ok, result = run_build(config(source, wan21_i2v_model, tmp_path / "out", mode="i2v", **GEOMETRY))
    assert ok and result["done"] == 2, result
    _check_against_its_data_process(tmp_path / "out", wan21_i2v_model, videos, image=True, fused=False)
    stored = torch.load(_file(tmp_path / "out", 0), weights_only=True)[0]
    assert stored["y"].shape == (1, 20, 5, HEIGHT // 8, WIDTH // 8) and stored["clip_feature"].shape == (1, 257, 1280)


def test_wan21_t2v_files_are_what_diffsynths_own_data_process_saves(t2v_build, videos, wan21_model):
    _check_against_its_data_process(t2v_build[0], wan21_model, videos, image=False, fused=False)


def test_ti2v_5b_files_hold_its_first_frame_latents(tmp_path, source, videos, tiny_model):
    ok, result = run_build(config(source, tiny_model, tmp_path / "out", mode="i2v", **GEOMETRY))
    assert ok and result["done"] == 2, result
    _check_against_its_data_process(tmp_path / "out", tiny_model, videos, image=True, fused=True)
    stored = torch.load(_file(tmp_path / "out", 1), weights_only=True)[0]
    assert stored["fuse_vae_embedding_in_latents"] is True
    assert torch.equal(stored["first_frame_latents"], stored["input_latents"][:, :, :1])


def test_latentforge_reads_them_with_weights_only_and_a_pickled_object_is_damage(
    tmp_path, source, wan21_model, t2v_build
):
    out = tmp_path / "out"
    shutil.copytree(t2v_build[0], out)
    result = t2v_build[1]
    record = get_format("diffsynth").read(_file(out, 0))
    assert record["fingerprint"] == result["fingerprint"] and record["input_latents"].dim() == 4
    files = {k: v for k, v in tree_hashes(out).items() if k.endswith(".pth")}
    (out / "ledger" / "shard-0.jsonl").unlink()  # a crash before its ledger was sealed: the files are adopted
    ok, again = run_build(config(source, wan21_model, out, **GEOMETRY))
    assert ok and again["done"] == 2 and again["failed"] == 0, again
    assert {k: v for k, v in tree_hashes(out).items() if k.endswith(".pth")} == files
    decoded = decode_and_verify(out, n=2, device="cpu", report_dir=tmp_path / "decode")  # through that reader
    assert not decoded.problems and len(decoded.rows) == 2
    inspected = runner.invoke(app, ["inspect", str(out)])
    assert inspected.exit_code == 0 and "DiffSynth-Studio split training" in inspected.output, inspected.output
    buffer = io.BytesIO()  # what its own data_process saves holds PIL images: pickled objects
    torch.save(({"input_image": Image.new("RGB", (2, 2))}, {}, {}), buffer)
    _file(out, 1).write_bytes(buffer.getvalue())
    _, spec, latent_shape, text_shape = make_spec(config(source, wan21_model, out, **GEOMETRY))
    report = verify_out(out, spec, latent_shape=latent_shape, text_shape=text_shape)
    assert any("does not load with weights_only=True" in problem for problem in report.problems), report.problems


def test_what_no_diffsynth_trainer_reads_is_one_line_exit_2(tmp_path, source, wan21_model):
    flags = ["build", "--source", f"vbvr:{source}", "--model", str(wan21_model), "--device", "cpu"]
    geometry = ["--frames", str(FRAMES), "--height", str(HEIGHT), "--width", str(WIDTH)]
    for extra, said in (
        (["--format", "diffsynth"], "--text-padding raw: its consumer, DiffSynth-Studio"),
        (["--recipe", "diffsynth-wan", "--mode", "i2v"], "is a text-to-video Wan snapshot (WanPipeline)"),
    ):
        out = tmp_path / said.split()[0].strip("-")
        result = runner.invoke(app, [*flags, *geometry, "--out", str(out), *extra])
        assert result.exit_code == 2, result.output
        lines = [line for line in result.output.splitlines() if line.strip()]
        assert len(lines) == 1 and said in lines[0], result.output
        assert tree_hashes(out) == {}


def test_check_consumer_reads_every_file_with_diffsynths_own_dataset(t2v_build):
    """`latentforge check-consumer`: its own UnifiedDataset lists OUT and its LoadTorchPickle loads every file, after
    latentforge's own weights_only read of each."""
    out, _ = t2v_build
    ds.diffsynth()  # the wheel on the path: `diffsynth` importable, as where it is installed
    result = runner.invoke(app, ["check-consumer", str(out)])
    assert result.exit_code == 0, result.output
    assert result.output.strip() == (
        f"check-consumer: DiffSynth-Studio: 2 sample(s) read; one batch: input_latents 1×16×5×{HEIGHT // 8}×"
        f"{WIDTH // 8}, context 1×512×{torch.load(_file(out, 0), weights_only=True)[1]['context'].shape[2]}"
    )


def test_the_timestep_range_its_loss_draws_from_is_in_every_file_and_only_there(tmp_path, source, wan21_model):
    """``--max/--min-timestep-boundary`` (Wan2.2-A14B's experts each train on a range): stored where its training step
    reads it, in the fingerprint; refused, one line, for a format that stores none, or an empty range."""
    out = tmp_path / "expert"
    ok, result = run_build(config(source, wan21_model, out, **GEOMETRY, max_timestep_boundary=0.4, limit=1))
    assert ok and result["done"] == 1, result
    shared = torch.load(next(out.rglob("*.pth")), weights_only=True)[0]
    assert (shared["max_timestep_boundary"], shared["min_timestep_boundary"]) == (0.4, 0.0)
    default = make_spec(config(source, wan21_model, tmp_path / "d", **GEOMETRY))[1]
    expert = make_spec(config(source, wan21_model, out, **GEOMETRY, max_timestep_boundary=0.4))[1]
    assert default.fingerprint() != expert.fingerprint()
    flags = ["build", "--source", f"vbvr:{source}", "--model", str(wan21_model), "--out", str(tmp_path / "x")]
    for extra, said in (
        (["--format", "pt", "--min-timestep-boundary", "0.4"], "format pt stores no timestep range"),
        (["--recipe", "diffsynth-wan", "--min-timestep-boundary", "0.5", "--max-timestep-boundary", "0.5"], "below"),
    ):
        refused = runner.invoke(app, [*flags, *extra])
        assert refused.exit_code == 2 and refused.output.startswith("error:") and said in refused.output, refused.output


class _Payload:
    """Unpickled, it creates `marker`: what a hostile .pth would do under its trainer's ``weights_only=False``."""

    def __init__(self, marker: Path) -> None:
        self.marker = str(marker)

    def __reduce__(self):
        return (open, (self.marker, "w"))


def test_check_consumer_hands_its_loader_no_file_that_needs_more_than_weights_only(tmp_path, t2v_build):
    """Its loader unpickles with ``weights_only=False``: a payload among the files (one the ledgers name, or one they
    do not) is reported in one line and never run."""
    ds.diffsynth()
    marker = tmp_path / "ran"
    for where in ("named", "extra"):
        out = tmp_path / where
        shutil.copytree(t2v_build[0], out)
        target = _file(out, 1) if where == "named" else out / "planted.pth"
        torch.save(({"input_latents": _Payload(marker)}, {}, {}), target)
        result = runner.invoke(app, ["check-consumer", str(out)])
        assert result.exit_code != 0 and result.output.startswith("error:"), result.output
        assert len(result.output.strip().splitlines()) == 1 and not marker.exists(), result.output
    live = tmp_path / "live.pth"
    torch.save(({"input_latents": _Payload(tmp_path / "live")}, {}, {}), live)
    ds.diffsynth().operators.LoadTorchPickle()(str(live))  # its own loader: the payload is live
    assert (tmp_path / "live").exists()
