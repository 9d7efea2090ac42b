"""Autograd helpers shared by the op tests."""

import torch


class Densify(torch.autograd.Function):
    """Identity whose backward densifies the gradient: gradcheck and gradgradcheck compare
    strided gradients only, and the lookups' weight gradient is sparse."""

    @staticmethod
    def forward(ctx, x):
        return x.clone()

    @staticmethod
    def backward(ctx, grad):
        return grad.to_dense() if grad.layout != torch.strided else grad
