#include "models/generate.h"

#include <algorithm>
#include <cmath>
#include <optional>

#include <ATen/ATen.h>
#include <ATen/core/grad_mode.h>
#include <ATen/CPUGeneratorImpl.h>

#include "data/batch.h"
#include "models/causal_lm.h"
#include "models/layers/kv_cache.h"
#include "runtime/error.h"

namespace memtune::models {

std::vector<int32_t> generate(CausalLM& model, const std::vector<int32_t>& prompt, const GenerateOptions& o) {
  MEMTUNE_CHECK(!prompt.empty(), "generate: empty prompt");
  MEMTUNE_CHECK(std::isfinite(o.temperature) && o.temperature >= 0, "generate: temperature is ", o.temperature,
                "; it must be a finite number >= 0 (0 picks the most likely token)");
  MEMTUNE_CHECK(o.top_p >= 0 && o.top_p <= 1, "generate: top_p is ", o.top_p,
                "; it must lie in [0, 1] (the share of probability mass sampled from)");
  for (int32_t id : prompt)
    MEMTUNE_CHECK(id >= 0 && id < model.spec().vocab_size, "generate: the prompt holds token id ", id,
                  " but the model's vocab_size is ", model.spec().vocab_size,
                  "; the tokenizer does not belong to this model");
  at::NoGradGuard no_grad;
  at::Generator gen = at::detail::createCPUGenerator(o.seed);
  const int64_t max_positions = model.spec().max_position_embeddings;
  std::vector<int32_t> ids = prompt, out;
  std::optional<KVCache> cache;
  if (o.use_cache)
    cache.emplace(static_cast<int>(model.num_layers()),
                  std::min<int64_t>(max_positions, static_cast<int64_t>(prompt.size()) + o.max_new_tokens));
  int64_t held = 0;  // positions the cache holds: the next forward reads the tokens after them
  ForwardOptions fo;
  fo.last_logits_only = true;
  for (int64_t n = 0; n < o.max_new_tokens; ++n) {
    const int64_t length = static_cast<int64_t>(ids.size());
    if (length >= max_positions) break;
    data::Sample s;
    s.input_ids.assign(ids.begin() + held, ids.end());
    s.targets.assign(s.input_ids.size(), data::kIgnoreIndex);
    s.segment_ids.assign(s.input_ids.size(), 0);
    for (int64_t i = held; i < length; ++i) s.position_ids.push_back(static_cast<int32_t>(i));
    fo.kv_cache = cache ? &*cache : nullptr;
    // The next token's logits on the CPU, where the generator is: a seed samples the same
    // tokens whatever device the model is on.
    at::Tensor logits = model.forward(data::collate({s}, 1, 0), fo).logits[0][0].to(at::kCPU);
    if (cache && !cache->holds(length)) {
      // A layer attended without the cache (a custom architecture that calls
      // causal_segment_attention itself): the forwards that follow run the whole sequence.
      MEMTUNE_INTERNAL_ASSERT(held == 0, "generate: a layer left the key/value cache after position ", held);
      cache.reset();
    }
    held = cache ? length : 0;
    int64_t next;
    if (o.greedy || o.temperature <= 0) {
      next = logits.argmax().item<int64_t>();
    } else {
      at::Tensor p = at::softmax(logits.to(at::kDouble) / o.temperature, 0);
      auto [sorted, order] = p.sort(0, true);
      // Nucleus: the most likely tokens up to top_p of the mass, and always the first
      // (transformers' TopPLogitsWarper keeps min_tokens_to_keep = 1: top_p 0 is greedy).
      at::Tensor keep = (sorted.cumsum(0) - sorted) < o.top_p;
      keep[0] = true;
      sorted = sorted * keep;
      next = order[at::multinomial(sorted / sorted.sum(), 1, false, gen).item<int64_t>()].item<int64_t>();
    }
    ids.push_back(static_cast<int32_t>(next));
    out.push_back(static_cast<int32_t>(next));
    if (o.eos_id && next == *o.eos_id) break;
  }
  return out;
}

}  // namespace memtune::models
