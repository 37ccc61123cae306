"""What a trained adapter becomes outside the trainer: a merged 16-bit checkpoint (`merge`), GGUF files in
f16, q8_0 and the k-quants (`gguf`, with the k-quant block formats in `kquants`). The command line is
`python -m grpo.export` (`__main__`).
"""
