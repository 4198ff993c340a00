"""The naive per-sample reference of GradMAP's Stage 1 score (Eq. 5), straight from the definition.

Kept out of the library on purpose: tests and benchmarks compare the library's fast path with it.
"""

import torch


def naive_layer_scores(model, layers, input_ids):
    """One forward and one backward per calibration sample; for each layer, sum the squared norms of
    every parameter's `.grad`; average over samples."""
    was_training = model.training
    model.eval()
    totals = torch.zeros(len(layers), dtype=torch.float64)
    for sample in input_ids:
        model.zero_grad(set_to_none=True)
        batch = sample.unsqueeze(0).to(model.get_input_embeddings().weight.device)
        model(batch, labels=batch, use_cache=False).loss.backward()
        for position, layer in enumerate(layers):
            totals[position] += sum(p.grad.double().pow(2).sum().item() for p in layer.parameters() if p.grad is not None)
    model.zero_grad(set_to_none=True)
    model.train(was_training)
    return totals / input_ids.shape[0]
