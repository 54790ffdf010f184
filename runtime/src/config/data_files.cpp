// datasets' search for a local directory's data files (docs/tokenizers.md, "A dataset directory").
#include "config/data_files.h"

#include <algorithm>
#include <cctype>
#include <filesystem>
#include <fstream>
#include <iterator>
#include <map>
#include <regex>
#include <set>
#include <tuple>

#include "memrt/config_node.h"
#include "memrt/error.h"

namespace memrt {
namespace fs = std::filesystem;

namespace {

// datasets.splits' default splits and the words data_files.py looks for in names.
const std::vector<std::pair<std::string, std::vector<std::string>>> kSplitKeywords = {
    {"train", {"train", "training"}},
    {"validation", {"validation", "valid", "dev", "val"}},
    {"test", {"test", "testing", "eval", "evaluation"}},
};
const char* const kSep = "[-._ 0-9]";  // NON_WORDS_CHARS as a class

// FILES_TO_IGNORE: never data, whatever a pattern says.
const std::set<std::string> kIgnoredNames = {"README.md",         "config.json",     "dataset_info.json",
                                             "dataset_infos.json", "dummy_data.zip", "dataset_dict.json"};

// datasets' packaged builders by the extensions they read (packaged_modules._EXTENSION_TO_MODULE,
// lower-case); the folder builders also take each extension in upper case. A file is a data file
// when one of its suffixes is one of these, or .zip, .idx, .manifest, .txn (_ALL_ALLOWED_EXTENSIONS).
struct Builder {
  const char* module;
  const char* extensions;
  bool upper_too;
};
const Builder kBuilders[] = {
    {"json", ".json .jsonl .ndjson", false},
    {"text", ".txt", false},
    {"parquet", ".parquet .geoparquet .gpq", false},
    {"csv", ".csv .tsv", false},
    {"arrow", ".arrow", false},
    {"conll", ".conll .conllu", false},
    {"eval", ".eval", false},
    {"fasta", ".afa .fa .faa .fasta .ffn .fna .frn", false},
    {"fastq", ".fastq .fq", false},
    {"genbank", ".gb .gbk .genbank", false},
    {"harbor", ".md .toml", false},
    {"hdf5", ".h5 .hdf5", false},
    {"lance", ".lance", false},
    {"mmcif", ".cif .mmcif", false},
    {"tsfile", ".tsfile", false},
    {"vortex", ".vortex", false},
    {"webdataset", ".tar", false},
    {"xml", ".xml", false},
    {"pdb", ".ent .pdb", true},
    {"pdffolder", ".pdf", true},
    {"niftifolder", ".nii", true},
    {"meshfolder", ".glb .gltf .ply .stl", true},
    {"videofolder", ".avi .mkv .mov .mp4 .mpeg", true},
    {"audiofolder",
     ".3g2 .3gp .aiff .asf .au .avr .caf .f4v .flac .flv .htk .ircam .m4v .mat4 .mat5 .mp3 .mpc2k .mpg .mxf .nist "
     ".nut .ogg .ogm .opus .paf .pvf .raw .rf64 .sd2 .sds .svx .voc .w64 .wav .wavex .webm .wma .wmv .wve .xi",
     true},
    {"imagefolder",
     ".apng .blp .bmp .bufr .bw .cur .dcx .dds .dib .emf .eps .fit .fits .flc .fli .ftc .ftu .gbr .gif .grib .icb "
     ".icns .ico .iim .im .j2c .j2k .jfif .jp2 .jpc .jpe .jpeg .jpf .jpg .jpx .msp .pbm .pcd .pcx .pgm .png .pnm "
     ".ppm .ps .psd .pxr .ras .rgb .rgba .sgi .tga .tif .tiff .vda .vst .webp .wmf .xbm .xpm",
     true},
};
// Files the folder builders read as metadata (_ALL_METADATA_FILENAMES): last in the vote.
const std::set<std::string> kMetadataNames = {"instruction.md", "latest_version_hint.json", "metadata.csv",
                                              "metadata.jsonl", "metadata.parquet",  "task.toml"};

std::string lower(std::string s) {
  for (char& c : s) c = static_cast<char>(std::tolower(static_cast<unsigned char>(c)));
  return s;
}
std::string upper(std::string s) {
  for (char& c : s) c = static_cast<char>(std::toupper(static_cast<unsigned char>(c)));
  return s;
}

std::vector<std::string> components(const std::string& path) {
  std::vector<std::string> out;
  size_t start = 0;
  while (start <= path.size()) {
    const size_t slash = path.find('/', start);
    const size_t end = slash == std::string::npos ? path.size() : slash;
    out.push_back(path.substr(start, end - start));
    if (slash == std::string::npos) break;
    start = slash + 1;
  }
  return out;
}

// fnmatch within one component: *, ?, [set] with ranges and a leading ! or ^ for "not".
bool match_component(const char* p, const char* s) {
  for (; *p; ++p) {
    if (*p == '*') {
      while (p[1] == '*') ++p;
      for (const char* t = s;; ++t) {
        if (match_component(p + 1, t)) return true;
        if (!*t) return false;
      }
    }
    if (!*s) return false;
    if (*p == '?') {
      ++s;
      continue;
    }
    if (*p == '[') {
      const char* q = p + 1;
      const bool negate = *q == '!' || *q == '^';
      if (negate) ++q;
      bool in = false;
      const char* first = q;
      for (; *q && (*q != ']' || q == first); ++q) {
        if (q[1] == '-' && q[2] && q[2] != ']') {
          in |= static_cast<unsigned char>(*s) >= static_cast<unsigned char>(q[0]) &&
                static_cast<unsigned char>(*s) <= static_cast<unsigned char>(q[2]);
          q += 2;
        } else {
          in |= *s == *q;
        }
      }
      if (*q == ']') {  // a whole class; an unclosed '[' is a literal, as in fnmatch
        if (in == negate) return false;
        ++s;
        p = q;
        continue;
      }
    }
    if (*p != *s) return false;
    ++s;
  }
  return !*s;
}

bool match_components(const std::vector<std::string>& p, size_t i, const std::vector<std::string>& s, size_t j) {
  if (i == p.size()) return j == s.size();
  if (p[i] == "**") {
    for (size_t k = j; k <= s.size(); ++k)
      if (match_components(p, i + 1, s, k)) return true;
    return false;
  }
  return j < s.size() && match_component(p[i].c_str(), s[j].c_str()) && match_components(p, i + 1, s, j + 1);
}

std::string base_name(const std::string& path) {
  const size_t slash = path.rfind('/');
  return slash == std::string::npos ? path : path.substr(slash + 1);
}

// Each ".suffix" of a file name, as datasets splits it: "a.jsonl.gz" -> .jsonl, .gz (as written).
std::vector<std::string> suffixes(const std::string& path) {
  const std::vector<std::string> parts = components([&] {
    std::string name = base_name(path);
    std::replace(name.begin(), name.end(), '.', '/');
    return name;
  }());
  std::vector<std::string> out;
  for (size_t k = 1; k < parts.size(); ++k) out.push_back("." + parts[k]);
  return out;
}

// The builder of extension `e` as a file's suffix writes it (".jsonl"; ".PNG" too), or nullptr.
const Builder* builder_of(const std::string& e) {
  const std::string low = lower(e);
  for (const Builder& b : kBuilders) {
    const std::string list = std::string(" ") + b.extensions + " ";
    if (list.find(" " + low + " ") != std::string::npos)
      return (low == e || (b.upper_too && e == upper(low))) ? &b : nullptr;
  }
  return nullptr;
}

bool is_data_file(const std::string& path) {
  for (const std::string& e : suffixes(path))
    if (builder_of(e) || e == ".zip" || e == ".idx" || e == ".manifest" || e == ".txn") return true;
  return false;
}

struct Tree {
  std::vector<std::string> files;  // relative, '/'-separated, sorted as fsspec's glob returns them

  // resolve_pattern: the data files `pattern` matches. Hidden files and directories, and
  // directories named like __pycache__, are never matched by the patterns below (they name none).
  std::vector<std::string> resolve(const std::string& pattern) const {
    std::vector<std::string> out;
    for (const std::string& f : files) {
      if (!glob_match(pattern, f) || kIgnoredNames.count(base_name(f)) || !is_data_file(f)) continue;
      const std::vector<std::string> parts = components(f);
      const bool hidden = std::any_of(parts.begin(), parts.end(), [](const std::string& c) {
        return c[0] == '.' && c.find_first_not_of('.') != std::string::npos;
      });
      const bool special =
          std::any_of(parts.begin(), parts.end() - 1, [](const std::string& c) { return c.rfind("__", 0) == 0; });
      if (!hidden && !special) out.push_back(f);
    }
    return out;
  }
};

using Patterns = std::vector<std::pair<std::string, std::vector<std::string>>>;  // split -> patterns

// get_data_patterns: the first family of patterns that finds any file.
Patterns data_patterns(const Tree& tree, const std::string& dir) {
  const std::string sharded = "data/{split}-[0-9][0-9][0-9][0-9][0-9]-of-[0-9][0-9][0-9][0-9][0-9]*.*";
  auto with_split = [&](const std::string& split) {
    std::string p = sharded;
    return p.replace(p.find("{split}"), 7, split);
  };
  if (const std::vector<std::string> files = tree.resolve(with_split("*")); !files.empty()) {
    static const std::regex name(R"((.+)-[0-9]{5}-of-[0-9]{5}.*\..*)");
    static const std::regex valid(R"(^\w+(\.\w+)*$)");
    std::set<std::string> splits;
    for (const std::string& f : files) {
      std::smatch m;
      const std::string base = base_name(f);
      std::regex_search(base, m, name);
      if (!std::regex_match(m[1].str(), valid))
        throw FileError(dir + "/" + f, "names the split \"" + m[1].str() + "\"; a split name is letters, digits and "
                                                                           "_ (parts joined by dots): rename the file");
      splits.insert(m[1].str());
    }
    Patterns out;
    for (const auto& [split, words] : kSplitKeywords)
      if (splits.erase(split)) out.push_back({split, {with_split(split)}});
    for (const std::string& split : splits) out.push_back({split, {with_split(split)}});
    return out;
  }
  auto keyword_patterns = [](std::vector<const char*> bases) {
    Patterns out;
    for (const auto& [split, words] : kSplitKeywords) {
      std::vector<std::string> patterns;
      for (const std::string& word : words)
        for (std::string p : bases) {
          for (size_t at; (at = p.find("{keyword}")) != std::string::npos;) p.replace(at, 9, word);
          for (size_t at; (at = p.find("{sep}")) != std::string::npos;) p.replace(at, 5, kSep);
          patterns.push_back(p);
        }
      out.push_back({split, patterns});
    }
    return out;
  };
  const std::vector<Patterns> families = {
      {{"logs", {"**/*.eval"}}},
      {{"test", {"**/task.toml", "**/instruction.md"}}},
      keyword_patterns({"**/{keyword}/**", "**/{keyword}{sep}*/**", "**/*{sep}{keyword}/**", "**/*{sep}{keyword}{sep}*/**"}),
      keyword_patterns({"**/{keyword}{sep}*", "**/*{sep}{keyword}{sep}*"}),
      {{"train", {"**"}}},
  };
  for (const Patterns& family : families) {
    Patterns found;
    for (const auto& [split, patterns] : family)
      if (std::any_of(patterns.begin(), patterns.end(), [&](const std::string& p) { return !tree.resolve(p).empty(); }))
        found.push_back({split, patterns});
    if (!found.empty()) return found;
  }
  throw FileError(dir, "holds no data files (a .jsonl, .json or .txt file; datasets' other formats are named but "
                       "not read); point dataset_name at a directory with one, or set train_file to a file");
}

// infer_module_for_data_files_list: the builder of the most common suffix (metadata files last;
// ties to parquet, lance, vortex, arrow, jsonl, json, csv, then the larger name), or "zip" for an
// archive, or "" for none.
std::string infer_module(const std::vector<std::string>& files) {
  std::map<std::pair<std::string, bool>, int> count;
  for (const std::string& f : files)
    for (const std::string& e : suffixes(f)) ++count[{lower(e), kMetadataNames.count(base_name(f)) > 0}];
  std::vector<std::pair<std::pair<std::string, bool>, int>> order(count.begin(), count.end());
  auto key = [](const std::pair<std::pair<std::string, bool>, int>& c) {
    const std::string& e = c.first.first;
    return std::make_tuple(!c.first.second, c.second, e == ".parquet", e == ".lance", e == ".vortex", e == ".arrow",
                           e == ".jsonl", e == ".json", e == ".csv", e);
  };
  std::stable_sort(order.begin(), order.end(), [&](const auto& a, const auto& b) { return key(a) > key(b); });
  for (const auto& c : order) {
    if (const Builder* b = builder_of(c.first.first)) return b->module;
    if (c.first.first == ".zip") return "zip";
  }
  return "";
}

// DataFilesList.filter(extensions=...): the files with a suffix that is one of the module's
// extensions (lower-case) or .zip, whatever suffixes follow it (a compression's).
bool read_by(const std::string& module, const std::string& path) {
  const std::vector<std::string> ext = suffixes(path);
  return std::any_of(ext.begin(), ext.end(), [&](const std::string& e) {
    const Builder* b = builder_of(e);
    return e == ".zip" || (b && module == b->module && e == lower(e));
  });
}

}  // namespace

bool glob_match(const std::string& pattern, const std::string& path) {
  return match_components(components(pattern), 0, components(path), 0);
}

const std::vector<std::string>* LocalDataset::split(const std::string& name) const {
  for (const auto& [split, files] : splits)
    if (split == name) return &files;
  return nullptr;
}

std::string LocalDataset::split_names() const {
  std::string out;
  for (const auto& [split, files] : splits) out += (out.empty() ? "" : ", ") + split;
  return out;
}

namespace {

// README.md's YAML header (between its first two "---" lines), or null.
ConfigNode dataset_card(const std::string& dir) {
  const fs::path readme = fs::path(dir) / "README.md";
  std::ifstream in(readme);
  if (!in) return ConfigNode();
  const std::string text((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
  if (text.rfind("---\n", 0) != 0) return ConfigNode();
  const size_t end = text.find("\n---", 3);
  if (end == std::string::npos) return ConfigNode();
  return parse_yaml_text(text.substr(4, end - 3), readme.generic_string());
}

// sanitize_patterns of a config's data_files: a pattern or a list of them (the train split), or
// [{split, path: pattern or list}].
Patterns config_patterns(const ConfigNode& data_files) {
  if (data_files.is_string()) return {{"train", {data_files.as_string()}}};
  if (!data_files.is_array())
    throw data_files.error("expected a pattern, a list of them, or [{split: NAME, path: PATTERN}], found " +
                           data_files.describe());
  Patterns out;
  for (const ConfigNode& item : data_files.as_array()) {
    if (item.is_string()) {
      if (out.empty()) out.push_back({"train", {}});
      if (out.front().first != "train" || out.size() > 1) throw item.error("mixes patterns and {split, path} entries");
      out.front().second.push_back(item.as_string());
      continue;
    }
    const ConfigNode* split = item.is_object() ? item.find("split") : nullptr;
    const ConfigNode* path = item.is_object() ? item.find("path") : nullptr;
    if (!split || !path) throw item.error("expected {split: NAME, path: PATTERN or [PATTERN, ...]}");
    out.push_back({split->as_string(), path->is_array() ? path->as_names() : std::vector<std::string>{path->as_string()}});
  }
  return out;
}

// The patterns of each split: README.md's config `config_name` (or its default one), else the
// directory's own; `inference`: the patterns datasets infers the format from (its first config's);
// `prefix`: the config's data_dir ("sub/"), which its patterns are relative to, or "".
Patterns split_patterns(const Tree& tree, const std::string& dir, const std::string& config_name, Patterns& inference,
                        std::string& prefix) {
  const ConfigNode card = dataset_card(dir);
  const ConfigNode* configs = card.is_object() ? card.find("configs") : nullptr;
  prefix.clear();
  if (!configs || configs->is_null()) {
    if (!config_name.empty() && config_name != "default")
      throw FileError(dir, "has no configs in its README.md, only \"default\", and no config \"" + config_name +
                               "\": leave dataset_config_name out");
    return inference = data_patterns(tree, dir);
  }
  if (!configs->is_array() || configs->as_array().empty())
    throw configs->error("expected a list of {config_name, data_files}, found " + configs->describe());
  const ConfigNode* chosen = nullptr;
  std::string names, default_name;
  for (const ConfigNode& c : configs->as_array()) {
    const ConfigNode* name = c.is_object() ? c.find("config_name") : nullptr;
    if (!name) throw c.error("has no config_name; each config names itself");
    names += (names.empty() ? "" : ", ") + name->as_string();
    const ConfigNode* is_default = c.find("default");
    if (configs->as_array().size() == 1 || name->as_string() == "default" || (is_default && is_default->as_bool())) {
      if (!default_name.empty())
        throw c.error("is a second default config (\"" + default_name + "\" is one); datasets refuses the card");
      default_name = name->as_string();
      if (config_name.empty()) chosen = &c;
    }
    if (!config_name.empty() && name->as_string() == config_name) chosen = &c;
  }
  if (!chosen)
    throw FileError(dir, config_name.empty() ? "has several configs in its README.md (" + names +
                                                   ") and none is the default: set dataset_config_name to one"
                                             : "has no config \"" + config_name + "\" in its README.md; it has " + names);
  const ConfigNode& first = configs->as_array().front();
  const ConfigNode* first_files = first.find("data_files");
  inference = first_files && !first_files->is_null() ? config_patterns(*first_files) : data_patterns(tree, dir);
  if (const ConfigNode* data_dir = chosen->find("data_dir"); data_dir && !data_dir->is_null())
    prefix = fs::path(data_dir->as_string()).lexically_normal().generic_string() + "/";
  const ConfigNode* files = chosen->find("data_files");
  if (files && !files->is_null()) return config_patterns(*files);
  if (prefix.empty()) return data_patterns(tree, dir);
  Tree sub;
  for (const std::string& f : tree.files)
    if (f.rfind(prefix, 0) == 0) sub.files.push_back(f.substr(prefix.size()));
  return data_patterns(sub, dir + "/" + prefix);
}

}  // namespace

LocalDataset find_local_dataset(const std::string& dir, const std::string& config_name) {
  Tree tree;
  std::error_code ec;
  for (auto it = fs::recursive_directory_iterator(dir, fs::directory_options::follow_directory_symlink, ec);
       !ec && it != fs::recursive_directory_iterator(); it.increment(ec)) {
    if (it->is_regular_file(ec)) tree.files.push_back(it->path().lexically_relative(dir).generic_string());
  }
  if (ec) throw FileError(dir, "cannot be listed: " + ec.message());
  std::sort(tree.files.begin(), tree.files.end());

  Patterns inference;
  std::string prefix;
  const Patterns patterns = split_patterns(tree, dir, config_name, inference, prefix);
  auto resolve = [&](const std::vector<std::string>& list, const std::string& from, const std::string& split) {
    std::vector<std::string> files;
    for (const std::string& p : list) {
      const std::vector<std::string> found = tree.resolve(from + p);
      if (found.empty() && p.find_first_of("*?[") == std::string::npos)
        throw FileError((fs::path(dir) / (from + p)).generic_string(), "is named by the " + split +
                                                                            " split's data_files and does not exist");
      files.insert(files.end(), found.begin(), found.end());
    }
    return files;
  };
  // infer_module_for_data_files: one format for every split, from the patterns datasets infers it from.
  std::string module;
  for (const auto& [split, list] : inference) {
    const std::string m = infer_module(resolve(list, "", split));
    if (split != inference.front().first && m != module)
      throw FileError(dir, "holds " + module + " files for its " + inference.front().first + " split and " + m +
                               " files for " + split + "; datasets reads one format: keep one");
    module = m;
  }
  if (module.empty()) throw FileError(dir, "holds no data files of a format datasets reads");
  LocalDataset out;
  out.module = module;
  for (const auto& [split, list] : patterns) {
    std::vector<std::string> files;
    for (const std::string& f : resolve(list, prefix, split))
      if (read_by(module, f)) files.push_back((fs::path(dir) / f).generic_string());
    out.splits.push_back({split, files});
  }
  return out;
}

}  // namespace memrt
