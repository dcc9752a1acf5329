"""Family plugins: a tiny plugin package (its own pyproject.toml, in the test's temp dir) installed into the venv
with an entry point in ``latentforge.families``, and the same family by ``--family module:attr``; each builds a
cache through the CLI, and verify, reconcile and decode-and-verify (a PSNR gate) run on it unchanged."""

from __future__ import annotations

import hashlib
import json
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
from typer.testing import CliRunner

from flows.cli import app
from infra.cache import ledger
from infra.models.plugins import PLUGIN_KEY
from tests.image_media import sample_images, write_folder
from tests.procs import cli_env

DIST, MODULE, ENTRY = "latentforge-tinyconv-plugin", "lf_tinyconv", "tinyconv"
HEIGHT, WIDTH = 32, 48
#: Latents of an orthonormal patch transform in bf16 decode to ~45 dB: the gate is real, and passes.
MIN_PSNR = 35.0
runner = CliRunner()

#: The plugin: a fixed random orthonormal 4x4-patch transform (48 channels) in plain torch, so decode inverts it.
PLUGIN = textwrap.dedent(
    '''
    """A latentforge family plugin: an orthonormal patch "VAE" in plain torch."""
    from __future__ import annotations

    import json
    from pathlib import Path

    import torch
    from safetensors.torch import load_file, save_file

    from infra.models.base import FamilySpec, GeometryRules, LoadedFamily, TextSettings

    PATCH = 4


    def make_model(directory: Path, seed: int = 0) -> Path:
        """vae/config.json + vae/weights.safetensors: a seeded orthonormal matrix over 3*PATCH*PATCH values."""
        generator = torch.Generator().manual_seed(seed)
        q, _ = torch.linalg.qr(torch.randn(3 * PATCH * PATCH, 3 * PATCH * PATCH, generator=generator))
        (Path(directory) / "vae").mkdir(parents=True)
        save_file({"q": q.contiguous()}, str(Path(directory) / "vae" / "weights.safetensors"))
        (Path(directory) / "vae" / "config.json").write_text(json.dumps({"patch": PATCH}))
        return Path(directory)


    class Encoder(LoadedFamily):
        name = "tinyconv"

        def __init__(self, model_dir: Path) -> None:
            self.q = load_file(str(Path(model_dir) / "vae" / "weights.safetensors"))["q"]

        def encode_video(self, pixels: torch.Tensor) -> torch.Tensor:
            image = pixels[0, :, 0].float()  # (3, H, W)
            patches = torch.nn.functional.unfold(image[None], PATCH, stride=PATCH)[0]  # (48, L)
            h, w = image.shape[1] // PATCH, image.shape[2] // PATCH
            return (self.q @ patches).reshape(-1, h, w)

        def encode_text(self, prompt: str, settings: TextSettings):
            raise NotImplementedError("captions are stored as text only")

        def decode(self, latents: torch.Tensor) -> torch.Tensor:
            c, h, w = latents.shape
            patches = self.q.T @ latents.float().reshape(c, h * w)
            image = torch.nn.functional.fold(patches[None], (h * PATCH, w * PATCH), PATCH, stride=PATCH)[0]
            return image.clamp(-1, 1).unsqueeze(1)


    class TinyConvFamily(FamilySpec):
        name = "tinyconv"
        media = "image"
        components = ("vae",)
        latent_norm = "orthonormal patch transform, none"
        output_kinds = ("latents",)
        defaults = {"temporal": "head", "resize": "cover-crop", "text_max_length": 1, "text_stage": "last_hidden_state"}

        def matches(self, model_dir, index):
            return False

        def rules(self, model_dir):
            return GeometryRules(frame_multiple=1, frame_remainder=0, spatial_multiple=PATCH)

        def latent_shape(self, model_dir, frames, height, width):
            return (3 * PATCH * PATCH, height // PATCH, width // PATCH)

        def text_shape(self, model_dir, settings):
            return ()

        def load(self, model_dir, device, dtype):
            return Encoder(model_dir)
    '''
)


def _package(root: Path) -> Path:
    (root / MODULE).mkdir(parents=True)
    (root / MODULE / "__init__.py").write_text(PLUGIN)
    (root / "pyproject.toml").write_text(
        textwrap.dedent(
            f"""
            [build-system]
            requires = ["setuptools>=61"]
            build-backend = "setuptools.build_meta"

            [project]
            name = "{DIST}"
            version = "0.1.0"

            [project.entry-points."latentforge.families"]
            {ENTRY} = "{MODULE}:TinyConvFamily"

            [tool.setuptools]
            packages = ["{MODULE}"]
            """
        )
    )
    return root


def _pip(*args: str) -> None:
    subprocess.run([sys.executable, "-m", "pip", "--quiet", "--disable-pip-version-check", *args], check=True)


@pytest.fixture
def installed(tmp_path: Path):
    """The plugin package installed into the venv (no dependencies, no build isolation); uninstalled after."""
    _pip("install", "--no-deps", "--no-build-isolation", "--no-index", str(_package(tmp_path / "plugin")))
    try:
        yield tmp_path / "plugin" / MODULE / "__init__.py"
    finally:
        _pip("uninstall", "--yes", DIST)


def _build(family: str, src: Path, model: Path, out: Path) -> list[str]:
    return [
        *("build", "--source", f"folder:{src}", "--model", str(model), "--out", str(out), "--family", family),
        *("--height", str(HEIGHT), "--width", str(WIDTH), "--device", "cpu", "--dtype", "fp32"),
        *("--decode-samples", "2", "--min-psnr", str(MIN_PSNR), "--on-conflict", "abort", "--on-loss", "abort"),
    ]


def _model(tmp_path: Path, module: object) -> Path:
    return module.make_model(tmp_path / "model", seed=0)  # type: ignore[attr-defined]


def test_an_installed_entry_point_family_builds_verifies_reconciles_and_decodes(tmp_path, installed):
    import importlib  # noqa: PLC0415

    importlib.invalidate_caches()
    plugin = importlib.import_module(MODULE)
    model, src, out = _model(tmp_path, plugin), write_folder(tmp_path / "photos", sample_images()), tmp_path / "out"
    result = runner.invoke(app, _build(ENTRY, src, model, out))
    assert result.exit_code == 0, result.output
    spec = json.loads((out / "cache.json").read_text())["spec"]
    assert spec["family"] == ENTRY
    sha = hashlib.sha256(installed.read_bytes()).hexdigest()
    assert spec["model_identity"][PLUGIN_KEY] == f"{DIST}==0.1.0;sha256:{sha}"  # the plugin's code is identity
    rows = ledger.read_shard(out, "photos-00000")
    assert len(rows) == len(sample_images()) and {r.status for r in rows.values()} == {"done"}
    decoded = json.loads(next((out / "reports" / "decode").rglob("report.json")).read_text())
    assert decoded["ok"] and min(r["psnr"] for r in decoded["rows"]) >= MIN_PSNR
    verified = runner.invoke(app, ["verify", str(out)])
    assert verified.exit_code == 0 and "COMPATIBLE" in verified.output, verified.output
    # a fresh process finds the family by its entry point alone, from cache.json
    command = [sys.executable, "-m", "flows.cli", "reconcile", str(out)]
    done = subprocess.run(command, env=cli_env(tmp_path / "home"), capture_output=True, text=True, timeout=300)
    assert done.returncode == 0 and "reconcile: OK (6 of 6" in done.stdout, (done.stdout[-2000:], done.stderr[-2000:])


def test_a_module_attr_family_builds_and_an_edit_changes_the_fingerprint(tmp_path, monkeypatch):
    import importlib  # noqa: PLC0415

    local = tmp_path / "local"
    local.mkdir()
    (local / "tinyconv_local.py").write_text(PLUGIN)
    monkeypatch.syspath_prepend(str(local))
    plugin = importlib.import_module("tinyconv_local")
    name = "tinyconv_local:TinyConvFamily"
    model, src, out = _model(tmp_path, plugin), write_folder(tmp_path / "photos", sample_images()[:2]), tmp_path / "out"
    result = runner.invoke(app, _build(name, src, model, out))
    assert result.exit_code == 0, result.output
    meta = json.loads((out / "cache.json").read_text())
    assert meta["spec"]["family"] == name and meta["spec"]["model_identity"][PLUGIN_KEY].startswith("-;sha256:")
    for step in (["verify", str(out)], ["reconcile", str(out)], ["decode", str(out), "--min-psnr", str(MIN_PSNR)]):
        done = runner.invoke(app, step)
        assert done.exit_code == 0, (step, done.output)
    from infra.models import get_family, model_identity  # noqa: PLC0415

    before = model_identity(model, get_family(name))[PLUGIN_KEY]
    (local / "tinyconv_local.py").write_text(PLUGIN + "\n# edited\n")
    assert model_identity(model, get_family(name))[PLUGIN_KEY] != before


def test_a_broken_or_wrong_plugin_is_a_clear_error(tmp_path, monkeypatch):
    (tmp_path / "notafamily.py").write_text("class Thing:\n    pass\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    for name, message in (
        ("notafamily:Thing", "not a FamilySpec"),
        ("notafamily:Missing", "has no Missing"),
        ("no_such_module_xyz:Family", "cannot import no_such_module_xyz"),
        ("no-such-family", "unknown family 'no-such-family'"),
    ):
        result = runner.invoke(app, _build(name, tmp_path, tmp_path, tmp_path / "out"))
        assert result.exit_code == 2 and message in result.output, (name, result.output)
