"""Fitting the tiny Wan2.2 VAE to a handful of clips in under a minute on a CPU (`make-tiny-model --train-on`).

`linear_init` sets the network's linear path to a closed-form hierarchical PCA codec of the clips; `train` then
fine-tunes it for a few hundred steps. The result is a real `AutoencoderKLWan` snapshot whose reconstructions are
recognisable (≥ 20 dB PSNR on the demo clips), so the demo's decode-and-verify has something to show.
"""
