"""The served /v1/embeddings of a generative family against transformers, shared by the families'
server tests (test_harmony's gpt-oss, test_deepseek_tools' deepseek2); test_embeddings.py checks
every pooling on llama's exact math."""

from __future__ import annotations

import numpy as np


def check_embeddings(client, hf_model, width: int) -> None:
    """The server's embedding of token ids is the last token's hidden state after the final norm
    (the pooling a generative model gets: --pooling auto), as transformers computes it on the same
    file, within 5% of its largest value (the int8 math quantizes every product's activations; the
    mean over the tokens is off by more than 20%: the check can fail). Texts give unit vectors of
    the model's width, the same text the same one, another text another."""
    import torch

    ids = [int(t) for t in np.random.default_rng(0).integers(3, 500, 20)]
    with torch.no_grad():
        ref = hf_model(torch.tensor([ids]), output_hidden_states=True).hidden_states[-1][0].numpy()
    res = client.embeddings.create(model="tiny", input=[ids], extra_body={"embd_normalize": -1})
    got = np.array(res.data[0].embedding)
    scale = np.abs(ref[-1]).max()
    np.testing.assert_allclose(got, ref[-1], rtol=0, atol=0.05 * scale)
    assert np.abs(got - ref.mean(axis=0)).max() > 0.2 * scale
    assert res.usage.prompt_tokens == len(ids)
    res = client.embeddings.create(model="tiny", input=["hello world", "hello world", "other"])
    a, b, c = (np.array(d.embedding) for d in res.data)
    assert len(a) == width and abs(np.linalg.norm(a) - 1) < 1e-5
    np.testing.assert_allclose(a, b, rtol=0, atol=1e-6)
    assert not np.allclose(a, c, atol=1e-3)
