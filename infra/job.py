"""Job: what the stages below the plan take of a build (`infra.plan.resolve` makes it; the plan carries it).

One frozen, picklable object is what a shard task (on a thread or a Ray worker), the one-sample sanity, the gates,
the audit and the decoders (a decoder process takes it once) get: the spec, the fingerprint and what the family makes
(its output kinds, the shapes of a sample), where OUT, the samples and the model are, what this run selects, the caps
checked before a clip is read, how the run goes (device, batching, memory; never the bytes), and what the gates
decided (an approved overwrite, the stale samples replaced or kept). A stage reads the spec for what decides the bytes
and the job for the rest; it never reads the raw config (`BuildConfig`): a value the spec resolves (the video batch,
the dtype) is read from the spec, and a run value that is not the spec's (how many clips one VAE call gathers) is
named here. The plan's shards and listing stay with the plan (`infra.plan.BuildPlan`); a step over every shard takes
them beside the job.
"""

from __future__ import annotations

from pathlib import Path

from pydantic import BaseModel, ConfigDict, Field

from infra import outdir
from infra.config import BuildConfig, CacheSpec, LimitsConfig, RunConfig, SelectionConfig
from infra.fetch import local_model
from infra.outstore import StoreOut


class Job(BaseModel):
    """A build's part below the plan, frozen and picklable: it travels to Ray workers and decoder processes."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    out: Path | StoreOut = Field(description="OUT: a local folder, or a StoreOut for a URL (`infra.outdir.root`)")
    family: str
    spec: CacheSpec
    fingerprint: str = Field(description="The spec's fingerprint (`CacheSpec.fingerprint`)")
    kinds: tuple[str, ...] = Field(
        ("latents", "text_embeddings"),
        description="The output kinds every sample holds (latents, text_embeddings, audio_latents for an audio run)",
    )
    latent_shape: tuple[int, ...] = Field(description="A sample's latents (the first bucket's, with buckets)")
    text_shape: tuple[int, ...] = Field(description="A sample's text embeddings")
    mask_multiples: tuple[int, int] | None = Field(
        None,
        description="The VAE's (frames, pixels) per latent step, where the mode lays a video mask on the latents' "
        "grid (None: no video mask)",
    )
    source: str = Field(description="KIND:PATH of the samples")
    model: str = Field(description="The model directory, as given (or its URL: `infra.fetch`)")
    model_parts: tuple[str, ...] = Field(
        (), description="The components a model given by URL is fetched for (`infra.fetch.local_model`)"
    )
    selection: SelectionConfig = Field(default_factory=SelectionConfig)
    limits: LimitsConfig = Field(default_factory=LimitsConfig)
    run: RunConfig = Field(default_factory=RunConfig)
    gather: int = Field(
        1,
        description="Clips of one shape gathered for one VAE call (--video-batch). The spec's video_batch is 1 with "
        "--vae-slicing, where the VAE encodes the gathered clips one at a time",
    )
    vae_slicing: bool = Field(False, description="The VAE encodes a gathered batch one clip at a time")
    replace_from: str | None = Field(
        None,
        description="Set only by an approved overwrite: the fingerprint (foreign for no cache.json) whose files may "
        "be replaced",
    )
    stale_replace: frozenset[str] = Field(
        frozenset(), description="Set only by the stale gate: SHARD/KEY of the stale samples to re-encode"
    )
    stale_keep: frozenset[str] = Field(
        frozenset(), description="Set only by the stale gate: SHARD/KEY of the stale samples the cache knowingly keeps"
    )
    keep_unowned: frozenset[str] = Field(
        frozenset(),
        description="Set only by the conflict gate (reuse, decided by a person): the OUT-relative files its consumer "
        "would load that no ledger row owns, kept as the preview listed them",
    )
    remove_unowned: frozenset[str] = Field(
        frozenset(),
        description="Set only by an approved overwrite: the OUT-relative files its consumer would load that no ledger "
        "row owns, removed before the first sample (those the preview listed)",
    )

    @classmethod
    def of(cls, config: BuildConfig, model_parts: tuple[str, ...] = (), **resolved: object) -> Job:
        """The job of `config` (its recipe applied: `infra.plan.resolve`) with what `resolve` made of it (`resolved`:
        the family, spec, fingerprint, kinds, shapes, mask multiples)."""
        return cls(
            out=outdir.root(config.out),
            source=config.source,
            model=config.model,
            model_parts=model_parts,
            selection=config.selection,
            limits=config.limits,
            run=config.run,
            gather=config.encoding.video_batch,
            vae_slicing=config.encoding.vae_slicing,
            **resolved,
        )

    @property
    def model_dir(self) -> Path:
        """The model's local folder (a model given by URL: fetched once per machine)."""
        return local_model(self.model, self.model_parts)

    @property
    def device(self) -> str:
        return self.run.device

    @property
    def video(self) -> bool:
        """Whether a sample has a video to decode (False: an audio-only mode's, whose media is its audio)."""
        return "latents" in self.kinds

    def placed(self, device: str) -> Job:
        """The job run on `device` (a shard task placed on ``cuda:N``)."""
        return self.model_copy(update={"run": self.run.model_copy(update={"device": device})})
