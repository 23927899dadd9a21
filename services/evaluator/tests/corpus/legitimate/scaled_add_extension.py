# class: legitimate: the candidate's own C++ loop does the work (allocation, layout and shape queries only from torch)
# task: scaled_add
# expect[permissive]: VERDICT_CORRECT
# expect[kevin-strict]: VERDICT_CORRECT
import torch
from torch.utils.cpp_extension import load_inline

cpp_source = r"""
#include <torch/extension.h>

torch::Tensor scaled_add(torch::Tensor a, torch::Tensor b, double alpha) {
    TORCH_CHECK(a.sizes() == b.sizes() && a.scalar_type() == torch::kFloat32, "two float32 tensors of one shape");
    auto x = a.contiguous();
    auto y = b.contiguous();
    auto out = torch::empty_like(x);
    const float* xs = x.data_ptr<float>();
    const float* ys = y.data_ptr<float>();
    float* os = out.data_ptr<float>();
    const float scale = static_cast<float>(alpha);
    const int64_t n = x.numel();
    for (int64_t i = 0; i < n; ++i) {
        os[i] = scale * xs[i] + ys[i];
    }
    return out.view(a.sizes());
}
"""

ext = load_inline(name="kforge_corpus_scaled_add_own", cpp_sources=cpp_source, functions=["scaled_add"])


class ModelNew(torch.nn.Module):
    def __init__(self, alpha):
        super().__init__()
        self.alpha = alpha

    def forward(self, a, b):
        return ext.scaled_add(a, b, self.alpha)
