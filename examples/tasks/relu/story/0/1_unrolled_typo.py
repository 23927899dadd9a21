import torch
from torch.utils.cpp_extension import load_inline

cpp_source = r"""
#include <torch/extension.h>

torch::Tensor relu_forward(torch::Tensor x) {
    TORCH_CHECK(x.scalar_type() == torch::kFloat32, "float32 input expected");
    auto input = x.contiguous();
    auto output = torch::empty_like(input);
    const float* in = input.data_ptr<float>();
    float* out = output.data_ptr<float>();
    const int64_t n = input.numel();
    int64_t i = 0;
    for (; i + 4 <= len; i += 4) {
        out[i] = in[i] > 0.0f ? in[i] : 0.0f;
        out[i + 1] = in[i + 1] > 0.0f ? in[i + 1] : 0.0f;
        out[i + 2] = in[i + 2] > 0.0f ? in[i + 2] : 0.0f;
        out[i + 3] = in[i + 3] > 0.0f ? in[i + 3] : 0.0f;
    }
    for (; i < n; ++i) {
        out[i] = in[i] > 0.0f ? in[i] : 0.0f;
    }
    return output;
}
"""

relu_ext = load_inline(name="kforge_example_relu_unrolled_typo", cpp_sources=cpp_source, functions=["relu_forward"])


class ModelNew(torch.nn.Module):
    def __init__(self):
        super().__init__()

    def forward(self, x):
        return relu_ext.relu_forward(x)
