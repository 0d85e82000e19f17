#include "trainer/train_state.h"

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <fstream>
#include <sstream>

#include <ATen/ATen.h>
#include <spdlog/spdlog.h>

#include "models/io/safetensors.h"
#include "runtime/atomic_file.h"
#include "runtime/error.h"
#include "runtime/json_input.h"

namespace memtune::trainer {

namespace fs = std::filesystem;

namespace {

// Complete checkpoints, sorted by step. Temporary directories of interrupted writes are
// not checkpoints (their names do not parse).
std::vector<std::pair<int64_t, fs::path>> list_checkpoints(const fs::path& output_dir) {
  std::vector<std::pair<int64_t, fs::path>> out;
  fs::path root = output_dir / "checkpoints";
  if (!fs::is_directory(root)) return out;
  for (const auto& e : fs::directory_iterator(root)) {
    const std::string name = e.path().filename().string();
    if (!e.is_directory() || name.rfind("step-", 0) != 0) continue;
    const std::string digits = name.substr(5);
    if (digits.empty() || !std::all_of(digits.begin(), digits.end(), ::isdigit)) continue;
    if (!fs::exists(e.path() / "state.json")) continue;
    out.emplace_back(std::stoll(digits), e.path());
  }
  std::sort(out.begin(), out.end());
  return out;
}

// A checkpoint leaves in two moves: renamed to a temporary name (atomic: it stops being a
// checkpoint at once, whole), then deleted. A kill during the delete leaves a temporary
// that remove_stale_temporaries() removes with the next write, never a step-N directory
// with files missing.
void prune(const fs::path& dir) {
  const fs::path doomed = temporary_name_for(dir);
  std::error_code ec;
  fs::rename(dir, doomed, ec);
  MEMTUNE_CHECK(!ec, "save_total_limit: cannot move ", dir.string(), " aside to delete it: ", ec.message());
  fsync_path(dir.parent_path());
  remove_tree(doomed);
}

// Keys a resumed run may change (prefixes): where a step runs, how it is split and with which
// kernels (its math the same; its last bits may differ: an attention kernel, a device), how
// often it logs and saves. Every other key shapes what a step computes.
bool free_to_change_on_resume(const std::string& key) {
  static const std::vector<std::string> free = {
      "memory.", "runtime.", "distributed.", "model.device_map", "model.max_memory", "model.low_cpu_mem_usage",
      "model.attn_implementation", "training.output_dir", "training.resume_from_checkpoint",
      "training.logging_steps", "training.save_steps", "training.save_total_limit", "training.eval_steps",
      "training.logging_strategy", "training.save_strategy", "training.eval_strategy", "training.logging_first_step",
      "training.gradient_checkpointing_kwargs",
      "training.eval_accuracy_rows", "training.per_device_eval_batch_size", "training.per_device_train_batch_size",
      "training.gradient_accumulation_steps", "training.gradient_checkpointing", "training.activation_offload",
      "training.dataloader_", "training.report_to", "training.remove_unused_columns", "data.eval_file", "data.cache_dir",
      "training.max_steps", "training.num_train_epochs"};
  return std::any_of(free.begin(), free.end(), [&](const std::string& f) { return key.rfind(f, 0) == 0; });
}

}  // namespace

// step-N directories without state.json: only a delete that an older memtune was killed
// in leaves them (a checkpoint is renamed into place whole). They are not checkpoints
// (latest_checkpoint skips them), and nothing else would ever remove them.
int remove_incomplete_checkpoints(const fs::path& output_dir) {
  const fs::path root = output_dir / "checkpoints";
  std::error_code ec;
  if (!fs::is_directory(root, ec)) return 0;
  remove_stale_temporaries(root);
  int removed = 0;
  for (const auto& e : fs::directory_iterator(root)) {
    const std::string name = e.path().filename().string();
    if (!e.is_directory() || name.rfind("step-", 0) != 0 || name.find(".tmp-") != std::string::npos) continue;
    if (fs::exists(e.path() / "state.json")) continue;
    if (name.size() > 7 && name.compare(name.size() - 7, 7, ".shards") == 0)
      spdlog::warn("checkpoints: removing {}: optimizer shards of a save that did not complete", e.path().string());
    else
      spdlog::warn("checkpoints: removing {}: it has no state.json (left by an interrupted delete)", e.path().string());
    prune(e.path());
    ++removed;
  }
  return removed;
}

namespace {

// Every tensor of the file as a read-only view of its mapping (SafetensorsFile::view):
// host memory outside the device budget, as a model's weights are read.
std::map<std::string, at::Tensor> view_all(const fs::path& file) {
  std::map<std::string, at::Tensor> out;
  models::SafetensorsFile f(file);
  for (const auto& name : f.names()) out[name] = f.view(name);
  return out;
}

}  // namespace

nlohmann::json TrainState::to_json() const {
  nlohmann::json j = {{"step", step},
                      {"sampler", sampler},
                      {"scaler", scaler},
                      {"supervisor", supervisor},
                      {"optimizer", optimizer},
                      {"checkpoint_layers", checkpoint_layers},
                      {"activation_offload", activation_offload},
                      {"optimizer_offload", optimizer_offload},
                      {"world_size", world_size},
                      {"eval_due", eval_due},
                      {"total_steps", total_steps}};
  if (data_samples > 0) j["data"] = {{"samples", data_samples}, {"target_tokens", data_target_tokens}};
  if (!lr_scheduler.is_null()) j["lr_scheduler"] = lr_scheduler;
  if (best_metric) j["best"] = {{"metric", *best_metric}, {"step", best_step}, {"checkpoint", best_checkpoint}};
  return j;
}

TrainState TrainState::from_json(const nlohmann::json& j, const std::string& origin) {
  TrainState s;
  s.step = json_int(j, "step", 0, int64_t{1} << 40, origin);
  for (auto [key, dst] : {std::pair{"sampler", &s.sampler}, {"scaler", &s.scaler}, {"supervisor", &s.supervisor},
                          {"optimizer", &s.optimizer}}) {
    *dst = json_field(j, key, origin);
    MEMTUNE_CHECK(dst->is_object(), origin, ".", key, " is ", dst->dump(), "; expected an object");
  }
  if (j.contains("checkpoint_layers")) {
    const auto& v = j["checkpoint_layers"];
    MEMTUNE_CHECK(v.is_array() && std::all_of(v.begin(), v.end(), [](const auto& b) { return b.is_boolean(); }),
                  origin, ".checkpoint_layers is ", v.dump(), "; expected a list of true/false, one per layer");
    s.checkpoint_layers = v.get<std::vector<bool>>();
  }
  if (j.contains("world_size")) s.world_size = json_int(j, "world_size", 1, int64_t{1} << 20, origin);
  if (j.contains("total_steps")) s.total_steps = json_int(j, "total_steps", 0, int64_t{1} << 53, origin);
  if (j.contains("lr_scheduler")) s.lr_scheduler = j["lr_scheduler"];  // its schedule checks it (Plateau::restore)
  if (j.contains("best")) {  // absent from checkpoints of earlier versions and of runs that rank none
    const auto& b = j["best"];
    const std::string where = std::string(origin) + ".best";
    MEMTUNE_CHECK(b.is_object(), where, " is ", b.dump(), "; expected an object");
    const auto& m = json_field(b, "metric", where);
    MEMTUNE_CHECK(m.is_number() && std::isfinite(m.get<double>()), where, ".metric is ", m.dump(),
                  "; expected a finite number");
    s.best_metric = m.get<double>();
    s.best_step = json_int(b, "step", 0, int64_t{1} << 40, where);
    s.best_checkpoint = json_int(b, "checkpoint", 0, int64_t{1} << 40, where);
  }
  if (j.contains("data")) {  // absent from checkpoints of earlier versions
    const auto& d = j["data"];
    const std::string where = std::string(origin) + ".data";
    MEMTUNE_CHECK(d.is_object(), where, " is ", d.dump(), "; expected an object");
    s.data_samples = json_int(d, "samples", 1, int64_t{1} << 50, where);
    s.data_target_tokens = json_int(d, "target_tokens", 0, int64_t{1} << 60, where);
  }
  for (auto [key, dst] : {std::pair{"activation_offload", &s.activation_offload}, {"optimizer_offload", &s.optimizer_offload},
                          {"eval_due", &s.eval_due}})
    if (j.contains(key)) {  // absent from checkpoints of earlier versions
      MEMTUNE_CHECK(j[key].is_boolean(), origin, ".", key, " is ", j[key].dump(), "; expected true or false");
      *dst = j[key].get<bool>();
    }
  return s;
}

fs::path save_training_checkpoint(const fs::path& output_dir, const TrainState& state,
                                  const std::vector<std::pair<std::string, at::Tensor>>& trainable,
                                  const std::vector<std::pair<std::string, at::Tensor>>& optimizer,
                                  const at::Tensor& rng_state, const std::string& config_yaml,
                                  int save_total_limit, int optimizer_shards) {
  fs::path root = output_dir / "checkpoints";
  fs::create_directories(root);
  remove_stale_temporaries(root);
  fs::path final_dir = root / ("step-" + std::to_string(state.step));
  AtomicDirectory dir(final_dir, /*replace_existing=*/true);
  std::vector<std::pair<std::string, at::Tensor>> weights;
  for (const auto& [name, t] : trainable) weights.emplace_back(name, t.detach().to(at::kFloat).contiguous());
  models::save_safetensors(dir.path() / "trainable.safetensors", weights);
  if (optimizer_shards > 0) {
    // Each rank's shard, written and synced by that rank, moves in; a rank that owns no
    // tensor wrote none. The index (HF's format) names every tensor's shard.
    nlohmann::ordered_json index = {{"metadata", {{"world_size", std::to_string(optimizer_shards)}}},
                                    {"weight_map", nlohmann::ordered_json::object()}};
    uint64_t total = 0;
    for (int r = 0; r < optimizer_shards; ++r) {
      const fs::path src = optimizer_shard_path(output_dir, state.step, r, optimizer_shards);
      if (!fs::exists(src)) continue;
      const fs::path dst = dir.path() / src.filename();
      std::error_code ec;
      fs::rename(src, dst, ec);
      MEMTUNE_CHECK(!ec, "checkpoint: cannot move rank ", r, "'s optimizer shard ", src.string(), " into ",
                    dir.path().string(), ": ", ec.message());
      models::SafetensorsFile shard(dst);
      for (const auto& name : shard.names()) {
        index["weight_map"][name] = src.filename().string();
        total += shard.info(name).nbytes();
      }
    }
    index["metadata"]["total_size"] = std::to_string(total);
    write_file_atomic(dir.path() / "optimizer.safetensors.index.json", index.dump(2) + "\n");
  } else {
    models::save_safetensors(dir.path() / "optimizer.safetensors", optimizer);
  }
  models::save_safetensors(dir.path() / "rng.safetensors", {{"cpu", rng_state.contiguous()}});
  write_file_atomic(dir.path() / "config.yaml", config_yaml);
  write_file_atomic(dir.path() / "state.json", state.to_json().dump(2) + "\n");
  dir.commit();
  if (optimizer_shards > 0) remove_tree(optimizer_shard_path(output_dir, state.step, 0, 1).parent_path().parent_path());
  remove_incomplete_checkpoints(output_dir);
  if (save_total_limit > 0) {
    const auto all = list_checkpoints(output_dir);
    std::vector<int64_t> steps;
    for (const auto& [step, path] : all) steps.push_back(step);
    for (size_t i : checkpoints_to_prune(steps, save_total_limit, state.best_checkpoint)) prune(all[i].second);
  }
  return final_dir;
}

std::vector<size_t> checkpoints_to_prune(const std::vector<int64_t>& steps, int limit, int64_t best) {
  std::vector<size_t> out;
  if (limit <= 0 || steps.size() <= static_cast<size_t>(limit)) return out;
  const auto is_kept = [&](size_t i) { return i + 1 == steps.size() || (best > 0 && steps[i] == best); };
  size_t kept = 0;
  for (size_t i = 0; i < steps.size(); ++i) kept += is_kept(i);
  const size_t keep = std::max(static_cast<size_t>(limit), kept);
  size_t remaining = steps.size();
  for (size_t i = 0; i < steps.size() && remaining > keep; ++i)
    if (!is_kept(i)) {
      out.push_back(i);
      --remaining;
    }
  return out;
}

fs::path optimizer_shard_path(const fs::path& output_dir, int64_t step, int rank, int world) {
  char name[64];
  std::snprintf(name, sizeof name, "optimizer-%05d-of-%05d.safetensors", rank + 1, world);
  return output_dir / "checkpoints" / str_cat("step-", step, ".shards") / str_cat("rank-", rank) / name;
}

TrainingCheckpoint load_training_checkpoint(const fs::path& dir,
                                            const std::function<bool(const std::string&)>& want_optimizer) {
  MEMTUNE_CHECK(fs::is_directory(dir), "resume_from_checkpoint: '", dir.string(), "' is not a directory");
  for (const char* f : {"state.json", "trainable.safetensors", "rng.safetensors", "config.yaml"})
    MEMTUNE_CHECK(fs::exists(dir / f), dir.string(), ": missing ", f, " (not a memtune training checkpoint?)");
  MEMTUNE_CHECK(fs::exists(dir / "optimizer.safetensors") || fs::exists(dir / "optimizer.safetensors.index.json"),
                dir.string(), ": missing optimizer.safetensors (or, sharded, optimizer.safetensors.index.json): not a "
                "memtune training checkpoint?");
  TrainingCheckpoint c;
  std::ifstream in(dir / "state.json");
  std::stringstream text;
  text << in.rdbuf();
  const std::string state_file = (dir / "state.json").string();
  c.state = TrainState::from_json(parse_json(text.str(), state_file), state_file);
  const std::string name = dir.filename().string();
  MEMTUNE_CHECK(name.rfind("step-", 0) != 0 || name == "step-" + std::to_string(c.state.step), state_file,
                ": step is ", c.state.step, " but the directory is ", name,
                "; the checkpoint was renamed or damaged (its files would not continue that step)");
  c.trainable = view_all(dir / "trainable.safetensors");
  const models::CheckpointReader optimizer(dir, "optimizer");  // whole, or the shards its index names
  for (const auto& name : optimizer.names())
    if (!want_optimizer || want_optimizer(name)) c.optimizer[name] = optimizer.view(name);
  auto rng = view_all(dir / "rng.safetensors");
  MEMTUNE_CHECK(rng.count("cpu") && rng["cpu"].scalar_type() == at::kByte && rng["cpu"].dim() == 1,
                (dir / "rng.safetensors").string(), ": expected a uint8 tensor 'cpu' (the CPU generator's state)");
  c.rng_state = rng["cpu"].clone();
  std::ifstream cy(dir / "config.yaml");
  std::stringstream ss;
  ss << cy.rdbuf();
  c.config_yaml = ss.str();
  return c;
}

std::vector<fs::path> checkpoints_after(const fs::path& output_dir, int64_t step) {
  std::vector<fs::path> out;
  for (const auto& [s, path] : list_checkpoints(output_dir))
    if (s > step) out.push_back(path);
  return out;
}

fs::path latest_checkpoint(const fs::path& output_dir) {
  auto all = list_checkpoints(output_dir);
  return all.empty() ? fs::path() : all.back().second;
}

void check_resume_compatible(const Config& now, const Config& then_written, const fs::path& checkpoint,
                             int64_t world_now, int64_t world_then) {
  // Earlier versions took warmup_steps over warmup_ratio where both were set (both are
  // refused now): what that run trained by.
  Config then = then_written;
  if (then.training.warmup_steps > 0) then.training.warmup_ratio = 0;
  const auto a = flatten(now), b = flatten(then);
  for (const auto& [key, value] : a) {
    const auto it = b.find(key);
    const std::string before = it == b.end() ? std::string("(not set)") : it->second;
    if (before == value) continue;
    if (key == "training.max_steps" || key == "training.num_train_epochs") {
      spdlog::warn("resume_from_checkpoint: {} changed since the checkpoint ({} -> {}): the learning-rate schedule "
                   "after it follows the new length", key, before, value);
      continue;
    }
    MEMTUNE_CHECK(free_to_change_on_resume(key), "resume_from_checkpoint: ", key, " changed since the checkpoint ('",
                  before, "' -> '", value, "'); it changes what a step computes, so ", checkpoint.string(),
                  " cannot continue under it (start a new training.output_dir, or restore the key)");
  }
  if (world_then <= 0) world_then = world_now;  // older checkpoints: assumed the same
  // NEFTune scales each sample's noise by the padded length of its micro-batch: the same
  // samples must share micro-batches on the same ranks.
  if (now.training.neftune_noise_alpha > 0)
    MEMTUNE_CHECK(now.training.per_device_train_batch_size == then.training.per_device_train_batch_size &&
                      world_now == world_then,
                  "resume_from_checkpoint: training.neftune_noise_alpha scales each sample's noise by the padded "
                  "length of its micro-batch, and this run splits the steps otherwise (per_device_train_batch_size ",
                  then.training.per_device_train_batch_size, " on ", world_then, " ranks then, ",
                  now.training.per_device_train_batch_size, " on ", world_now, " now); resume with the same split");
  const int64_t per_rank_now = now.training.per_device_train_batch_size * now.training.gradient_accumulation_steps;
  const int64_t per_rank_then = then.training.per_device_train_batch_size * then.training.gradient_accumulation_steps;
  if (world_now == world_then) {
    MEMTUNE_CHECK(per_rank_now == per_rank_then, "resume_from_checkpoint: training.per_device_train_batch_size x "
                  "gradient_accumulation_steps changed since the checkpoint ('", per_rank_then, "' -> '", per_rank_now,
                  "'); the samples per step must stay the same (split them differently, not more or fewer)");
    return;
  }
  MEMTUNE_CHECK(per_rank_now * world_now == per_rank_then * world_then,
                "resume_from_checkpoint: a step trained on ", per_rank_then * world_then, " samples (", world_then,
                " ranks x ", per_rank_then, " = per_device_train_batch_size x gradient_accumulation_steps), this run "
                "has ", world_now, " ranks x ", per_rank_now, " = ", per_rank_now * world_now,
                "; the samples of a step over all ranks must stay the same. Hint: gradient_accumulation_steps or "
                "per_device_train_batch_size such that ", world_now, " x their product = ", per_rank_then * world_then);
}

}  // namespace memtune::trainer
