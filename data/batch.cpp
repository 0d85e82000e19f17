#include "data/batch.h"

#include <algorithm>

#include <ATen/Functions.h>

#include "runtime/error.h"

namespace memtune::data {

int64_t Sample::target_tokens() const {
  return std::count_if(targets.begin(), targets.end(), [](int32_t t) { return t != kIgnoreIndex; });
}

Batch collate(const std::vector<Sample>& samples, int64_t pad_multiple, int32_t pad_id) {
  MEMTUNE_CHECK(!samples.empty(), "collate: no samples");
  size_t longest = 0;
  for (const auto& s : samples) {
    MEMTUNE_CHECK(s.input_ids.size() == s.targets.size() &&
                      s.input_ids.size() == s.position_ids.size() &&
                      s.input_ids.size() == s.segment_ids.size(),
                  "collate: a sample's input_ids, targets, position_ids and segment_ids differ in length");
    longest = std::max(longest, s.input_ids.size());
  }
  const int64_t B = static_cast<int64_t>(samples.size());
  int64_t T = static_cast<int64_t>(longest);
  if (pad_multiple > 1) T = (T + pad_multiple - 1) / pad_multiple * pad_multiple;

  Batch b;
  b.input_ids = at::full({B, T}, pad_id, at::kLong);
  b.targets = at::full({B, T}, kIgnoreIndex, at::kLong);
  b.position_ids = at::zeros({B, T}, at::kLong);
  b.segment_ids = at::full({B, T}, -1, at::kLong);
  auto ids = b.input_ids.accessor<int64_t, 2>();
  auto tgt = b.targets.accessor<int64_t, 2>();
  auto pos = b.position_ids.accessor<int64_t, 2>();
  auto seg = b.segment_ids.accessor<int64_t, 2>();
  for (int64_t i = 0; i < B; ++i) {
    const Sample& s = samples[i];
    for (size_t t = 0; t < s.input_ids.size(); ++t) {
      ids[i][t] = s.input_ids[t];
      tgt[i][t] = s.targets[t];
      pos[i][t] = s.position_ids[t];
      seg[i][t] = s.segment_ids[t];
    }
    b.target_tokens += s.target_tokens();
    b.row_lengths.push_back(static_cast<int64_t>(s.input_ids.size()));
  }
  return b;
}

}  // namespace memtune::data
