"""Clip-weighted PCA and ridge least squares over feature rows (float64), for the closed-form initialisation."""

from __future__ import annotations

from dataclasses import dataclass

import torch


def rows(x: torch.Tensor) -> torch.Tensor:
    """(B, C, T, H, W) -> (B*T*H*W, C): one row per position, clip-major."""
    return x.permute(0, 2, 3, 4, 1).reshape(-1, x.shape[1])


@dataclass
class Fitter:
    """PCA / least squares over clip-major rows, each row weighted by its clip's weight; `subset` draws at most
    `max_rows` of them with `gen` (the seed makes the whole fit deterministic); `sub=None` uses every row."""

    clip_weights: list[float]
    gen: torch.Generator
    max_rows: int = 300_000

    def subset(self, n: int) -> torch.Tensor | None:
        return None if n <= self.max_rows else torch.randperm(n, generator=self.gen)[: self.max_rows]

    def _weights(self, n: int, sub: torch.Tensor | None) -> torch.Tensor:
        idx = torch.arange(n) if sub is None else sub
        w = torch.as_tensor(self.clip_weights, dtype=torch.float64)
        return w[idx // (n // len(w))][:, None]

    def pca(
        self, v: torch.Tensor, k: int, sub: torch.Tensor | None = None, forced: torch.Tensor | None = None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Weighted mean and the top-k orthonormal directions (D, k) of rows v; `forced` (D, m) come first."""
        wr = self._weights(len(v), sub)
        v = (v if sub is None else v[sub]).double()
        mu = (v * wr).sum(0) / wr.sum()
        c = v - mu
        cov = (c * wr).T @ c / wr.sum()
        basis = []
        if forced is not None:
            q, _ = torch.linalg.qr(forced.double())
            basis.append(q)
            proj = torch.eye(len(cov), dtype=cov.dtype) - q @ q.T
            cov = proj @ cov @ proj
            k -= q.shape[1]
        if k > 0:
            e, u = torch.linalg.eigh(cov)
            basis.append(u[:, e.argsort(descending=True)[:k]])
        return mu.float(), torch.cat(basis, 1).float()

    def lstsq(
        self, feat: torch.Tensor, target: torch.Tensor, sub: torch.Tensor | None = None, ridge: float = 1e-6
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """W (D, K), b (K) minimising the clip-weighted |feat @ W + b - target|² plus a ridge relative to the
        largest column variance: columns that carry (almost) nothing get no large weights, so the fitted net
        stays trainable, while every column with a real signal, however small, is used."""
        wr = self._weights(len(feat), sub)
        f = (feat if sub is None else feat[sub]).double()
        y = (target if sub is None else target[sub]).double()
        fm, ym = (f * wr).sum(0) / wr.sum(), (y * wr).sum(0) / wr.sum()
        a = (f - fm) * wr.sqrt()
        g = a.T @ a
        g += ridge * float(g.diagonal().max()) * torch.eye(len(g), dtype=g.dtype)
        w = torch.linalg.solve(g, a.T @ ((y - ym) * wr.sqrt()))
        return w.float(), (ym - fm @ w).float()
