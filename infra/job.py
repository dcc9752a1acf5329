"""ShardJob: what the stages below the plan take of a build besides its spec (`infra.plan.resolve` makes it).

A stage reads the spec for what decides the bytes and the job for the rest: where the samples and the model are, what
this run selects, the caps checked before a clip is read, how the run goes (device, batching, memory; never the
bytes). It never reads the raw config (`BuildConfig`): a value the spec resolves (the video batch, the dtype) is read
from the spec, and a run value that is not the spec's (how many clips one VAE call gathers) is named here.
"""

from __future__ import annotations

from pathlib import Path

from pydantic import BaseModel, ConfigDict, Field

from infra.config import BuildConfig, LimitsConfig, RunConfig, SelectionConfig
from infra.fetch import local_model


class ShardJob(BaseModel):
    """A build's run part, frozen and picklable: it travels with the plan to Ray workers and decoder processes."""

    model_config = ConfigDict(frozen=True, extra="forbid")

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

    @classmethod
    def of(cls, config: BuildConfig, model_parts: tuple[str, ...] = ()) -> ShardJob:
        """The job of `config` (its recipe applied: `infra.plan.resolve`)."""
        return cls(
            source=config.source,
            model=config.model,
            model_parts=model_parts,
            selection=config.selection,
            limits=config.limits,
            run=config.run,
            gather=config.encoding.video_batch,
            vae_slicing=config.encoding.vae_slicing,
        )

    @property
    def model_dir(self) -> Path:
        """The model's local folder (a model given by URL: fetched once per machine)."""
        return local_model(self.model, self.model_parts)

    @property
    def device(self) -> str:
        return self.run.device

    def placed(self, device: str) -> ShardJob:
        """The job run on `device` (a shard task placed on ``cuda:N``)."""
        return self.model_copy(update={"run": self.run.model_copy(update={"device": device})})
