// memory_report.html as a browser shows it: the page is rendered by headless Chromium and the
// test reads the DOM its script built, so a script error or a missing bar fails here rather than
// in front of a user. Chromium comes from `scripts/setup.sh --test`.
#include <gtest/gtest.h>

#include <sys/wait.h>
#include <unistd.h>

#include <cstdint>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <iostream>
#include <regex>
#include <sstream>
#include <string>
#include <utility>
#include <vector>

#include "memory/report_html.h"

namespace {

namespace fs = std::filesystem;

// Kept when a test fails, so that the page, the DOM, the screenshot and Chromium's log can be
// looked at; removed otherwise.
class TempDir {
 public:
  explicit TempDir(const std::string& name)
      : path_(fs::temp_directory_path() /
              ("memrt_report_html_" + name + "_" + std::to_string(::getpid()))) {
    fs::remove_all(path_);
    fs::create_directories(path_);
  }
  ~TempDir() {
    if (::testing::Test::HasFailure())
      std::cerr << "test files kept in " << path_.string() << "\n";
    else
      fs::remove_all(path_);
  }
  TempDir(const TempDir&) = delete;
  TempDir& operator=(const TempDir&) = delete;
  fs::path operator/(const std::string& name) const { return path_ / name; }

 private:
  fs::path path_;
};

std::string slurp(const fs::path& p) {
  std::ifstream in(p, std::ios::binary);
  std::stringstream s;
  s << in.rdbuf();
  return s.str();
}

void write(const fs::path& p, const std::string& text) {
  std::ofstream out(p, std::ios::binary);
  out << text;
}

std::string sh_quote(const std::string& s) {  // for sh -c
  std::string q = "'";
  for (char c : s) q += c == '\'' ? std::string("'\\''") : std::string(1, c);
  return q + "'";
}

// The binary Debian installs (`chromium`), or the name other distributions use.
std::string find_chromium() {
  const char* path = std::getenv("PATH");
  std::stringstream dirs(path ? path : "");
  std::vector<std::string> dir_list;
  for (std::string d; std::getline(dirs, d, ':');) dir_list.push_back(d.empty() ? "." : d);
  for (const char* name : {"chromium", "chromium-browser"})
    for (const std::string& d : dir_list) {
      fs::path p = fs::path(d) / name;
      if (::access(p.c_str(), X_OK) == 0) return p.string();
    }
  return "";
}

// Runs headless Chromium on `page` with `args`, bounded in time; its noise (D-Bus, GPU) goes to
// a log that failures print.
bool run_chromium(const TempDir& dir, const fs::path& page, const std::string& args,
                  const fs::path& out) {
  std::string chromium = find_chromium();
  if (chromium.empty()) {
    ADD_FAILURE() << "headless Chromium not found (looked for `chromium` and `chromium-browser` "
                     "on PATH); run scripts/setup.sh --test, which installs it (scripts/test.sh "
                     "does)";
    return false;
  }
  // A fresh profile per run: nothing from an earlier run or from a user's browser is read.
  static int runs = 0;
  fs::path profile = dir / ("profile" + std::to_string(runs++));
  fs::path log = dir / "chromium.log";
  std::string cmd = "timeout 60 " + sh_quote(chromium) +
                    " --headless --no-sandbox --disable-gpu --hide-scrollbars"
                    " --user-data-dir=" + sh_quote(profile.string()) + " " + args + " " +
                    sh_quote("file://" + fs::absolute(page).string()) +
                    " >" + sh_quote(out.string()) + " 2>" + sh_quote(log.string());
  int status = std::system(cmd.c_str());
  int rc = WIFEXITED(status) ? WEXITSTATUS(status) : -1;
  EXPECT_EQ(rc, 0) << (rc == 124 ? "Chromium timed out after 60 s: " : "Chromium failed: ") << cmd
                   << "\n" << slurp(log);
  return rc == 0;
}

// --- the hand-made report --------------------------------------------------------------------

const char* const kCategories[] = {"weights",     "master_weights", "gradients",
                                   "optimizer_state", "quant_state", "adapters",
                                   "activations", "comm_buffers",   "other",
                                   "unattributed"};

struct Cell {
  std::string category;
  int64_t device = 0;
  int64_t host = 0;
};

// All ten categories, as the writer emits them; the ones not in `cells` are zero.
std::string categories_json(const std::vector<Cell>& cells) {
  std::string s = "{";
  for (const char* name : kCategories) {
    Cell c{name};
    for (const Cell& given : cells)
      if (given.category == name) c = given;
    if (s.size() > 1) s += ", ";
    s += "\"" + c.category + "\": {\"device\": " + std::to_string(c.device) +
         ", \"host\": " + std::to_string(c.host) + "}";
  }
  return s + "}";
}

int64_t sum(const std::vector<Cell>& cells) {
  int64_t t = 0;
  for (const Cell& c : cells) t += c.device + c.host;
  return t;
}

// A GPT-2 of 3,279,360 parameters (docs/memory.md's example) in fp32 with AdamW on 2 ranks, its
// optimizer state offloaded to the host, as the estimate and the tracker would describe it.
constexpr int64_t kWeights = 13'117'440;   // 3,279,360 parameters x 4 bytes
constexpr int64_t kMoments = 26'234'880;   // 2 x 4 bytes per parameter
constexpr int64_t kHeadGrad = 262'144;     // the only gradient alive at the backward peak
constexpr int64_t kBatch = 65'536;         // 2 x 16 x 256 token ids x 8 bytes
constexpr int64_t kLeakPerStep = 4'194'304;

const std::vector<Cell> kEstimate = {
    {"weights", kWeights, 0},        {"gradients", kWeights, 0},
    {"optimizer_state", 0, kMoments}, {"activations", 109'051'904, 0},
    {"comm_buffers", kWeights, 0},    {"other", kBatch, 0}};
// The backward peak: all activations, only the head's gradient (docs/memory.md, "The peak").
constexpr int64_t kEstimatePeak = kWeights + kMoments + kHeadGrad + 109'051'904 + kWeights + kBatch;

// At the measured peak (the start of the first backward) the all-reduce bucket does not exist.
const std::vector<Cell> kMeasured0 = {
    {"weights", kWeights, 0},         {"gradients", kHeadGrad, 0},
    {"optimizer_state", 0, kMoments}, {"activations", 112'459'776, 0},
    {"other", kBatch, 0},             {"unattributed", 1'310'720, 0}};
// Rank 1 keeps a pinned staging buffer on the host and leaks activations (the leak below).
const std::vector<Cell> kMeasured1 = {
    {"weights", kWeights, 0},         {"gradients", kHeadGrad, 0},
    {"optimizer_state", 0, kMoments}, {"activations", 112'459'776 + 6 * kLeakPerStep, 0},
    {"other", kBatch, 1'048'576},     {"unattributed", 1'323'008, 0}};

std::string rank_json(int rank, const std::vector<Cell>& measured, int64_t leak_per_step) {
  const int64_t peak = sum(measured);
  const int64_t unattributed_live = 1'310'720;
  std::string timeline;
  int64_t live = 0;
  for (int step = 1; step <= 7; ++step) {
    // Step 1 peaks before the optimizer state exists; a leak adds to every step from step 2 on,
    // so with one the peak is the last step's.
    const int64_t leaked = (step - 1) * leak_per_step;
    const int64_t step_peak = step == 1 ? peak - kMoments - 6 * leak_per_step
                                        : peak - (7 - step) * leak_per_step;
    live = kWeights + kMoments + kBatch + unattributed_live + leaked;
    if (!timeline.empty()) timeline += ",\n        ";
    timeline += "{\"step\": " + std::to_string(step) + ", \"live_bytes\": " + std::to_string(live) +
                ", \"peak_bytes\": " + std::to_string(step_peak) +
                ", \"activations_peak_bytes\": " + std::to_string(112'459'776 + leaked) + "}";
  }
  std::string leaks = leak_per_step == 0
                          ? "[]"
                          : "[{\"category\": \"activations\", \"bytes_per_step\": " +
                                std::to_string(leak_per_step) +
                                ", \"first_step\": 2, \"last_step\": 7}]";
  return R"({
      "rank": )" + std::to_string(rank) + R"(,
      "estimate": {
        "categories": )" + categories_json(kEstimate) + R"(,
        "peak_bytes": )" + std::to_string(kEstimatePeak) + R"(,
        "terms": [
          {"source": "memrt", "categories": )" +
         categories_json({{"weights", kWeights, 0},
                          {"gradients", kWeights, 0},
                          {"optimizer_state", kMoments, 0},
                          {"activations", 109'051'904, 0},
                          {"comm_buffers", kWeights, 0},
                          {"other", kBatch, 0}}) + R"(},
          {"source": "zero", "categories": )" +
         categories_json({{"optimizer_state", -kMoments, kMoments}}) + R"(}
        ]
      },
      "measured": {
        "categories": )" + categories_json(measured) + R"(,
        "peak_bytes": )" + std::to_string(peak) + R"(,
        "peak_step": )" + std::to_string(leak_per_step ? 7 : 2) + R"(,
        "current_bytes": )" + std::to_string(live) + R"(,
        "allocations": 48213,
        "frees": 47920,
        "activations_kept_bytes": 96000000,
        "activations_peak_bytes": )" + std::to_string(112'459'776 + 6 * leak_per_step) + R"(
      },
      "timeline": [
        )" + timeline + R"(
      ],
      "leaks": )" + leaks + R"(,
      "resident_growth": )" + (leak_per_step == 0 ? std::string("null")
                                                   : std::string(R"({"step": 4, "since_step": 2, "resident_bytes": 812000000, )"
                                                                 R"("expected_bytes": 520000000, "allowed_bytes": 650000000, )"
                                                                 R"("categories": ["activations"]})")) + R"(
    })";
}

std::string two_rank_report() {
  std::string cats;
  for (const char* name : kCategories)
    cats += std::string(cats.empty() ? "" : ", ") + "\"" + name + "\"";
  return R"({
  "version": 1,
  "units": "bytes",
  "world_size": 2,
  "categories": [)" + cats + R"(],
  "ranks": [
    )" + rank_json(0, kMeasured0, 0) + ",\n    " + rank_json(1, kMeasured1, kLeakPerStep) + R"(
  ]
}
)";
}

// --- reading the DOM Chromium dumped -----------------------------------------------------------

std::string attr(const std::string& tag, const std::string& name) {
  std::smatch m;
  if (std::regex_search(tag, m, std::regex("\\s" + name + "=\"([^\"]*)\""))) return m[1];
  return "";
}

std::string rendered(const std::string& dom) {
  std::smatch m;
  if (std::regex_search(dom, m, std::regex("<body[^>]*\\sdata-rendered=\"([^\"]*)\""))) return m[1];
  return "(body has no data-rendered: the script did not finish)";
}

// A bar of the stacked chart: its rank, estimate or measured, and "category/placement" of each
// segment in drawing order.
struct Bar {
  std::string rank, kind;
  std::vector<std::string> segments;
};

std::vector<Bar> bars(const std::string& dom) {
  std::vector<Bar> out;
  const std::regex g_open("<g\\s[^>]*>"), rect("<rect\\s[^>]*>");
  for (auto it = std::sregex_iterator(dom.begin(), dom.end(), g_open); it != std::sregex_iterator();
       ++it) {
    std::string tag = it->str();
    if (attr(tag, "class") != "bar") continue;
    Bar bar{attr(tag, "data-rank"), attr(tag, "data-kind"), {}};
    // Segments hold only a <title>, never a <g>: the bar ends at the first </g>.
    size_t begin = static_cast<size_t>(it->position() + it->length());
    std::string body = dom.substr(begin, dom.find("</g>", begin) - begin);
    for (auto r = std::sregex_iterator(body.begin(), body.end(), rect); r != std::sregex_iterator();
         ++r)
      if (attr(r->str(), "class") == "segment")
        bar.segments.push_back(attr(r->str(), "data-category") + "/" +
                               attr(r->str(), "data-placement"));
    out.push_back(bar);
  }
  return out;
}

size_t occurrences(const std::string& text, const std::string& what) {
  size_t n = 0;
  for (size_t at = text.find(what); at != std::string::npos; at = text.find(what, at + 1)) ++n;
  return n;
}

// Width and height from a PNG's IHDR chunk; {0, 0} when `png` is not a PNG.
std::pair<uint32_t, uint32_t> png_size(const std::string& png) {
  if (png.size() < 24 || png.compare(0, 8, "\x89PNG\r\n\x1a\n") != 0) return {0, 0};
  auto be32 = [&](size_t at) {
    uint32_t v = 0;
    for (size_t i = 0; i < 4; ++i) v = v << 8 | static_cast<unsigned char>(png[at + i]);
    return v;
  };
  return {be32(16), be32(20)};
}

// --- tests -------------------------------------------------------------------------------------

TEST(ReportHtml, SelfContainedAndJsonCannotEndTheScript) {
  const std::string json =
      R"({"ranks": [{"rank": 0, "estimate": {"terms": [{"source": "</script><!--<script>"}]}}]})";
  const std::string page = memrt::render_memory_report_html(json);
  // Nothing is fetched: no external script, style sheet, image or font.
  for (const char* ref : {"src=", "<link", "@import", "url(http", "<img", "@font-face"})
    EXPECT_EQ(page.find(ref), std::string::npos) << "page refers to something outside it: " << ref;
  // The embedded JSON is inert: the only </script> are the two the template closes.
  EXPECT_EQ(occurrences(page, "</script>"), 2u);
  EXPECT_EQ(page.find("<!--"), std::string::npos);
  EXPECT_NE(page.find(R"(\u003c/script>\u003c!--\u003cscript>)"), std::string::npos);
}

TEST(ReportHtmlInChromium, TwoRanksBarsTimelineTableAndLeak) {
  TempDir dir("two_ranks");
  write(dir / "memory_report.json", two_rank_report());
  write(dir / "memory_report.html",
        memrt::render_memory_report_html(slurp(dir / "memory_report.json")));

  ASSERT_TRUE(run_chromium(dir, dir / "memory_report.html", "--dump-dom", dir / "dom.html"));
  const std::string dom = slurp(dir / "dom.html");
  ASSERT_EQ(rendered(dom), "ok") << dom;

  // One estimate and one measured bar per rank, one segment per non-zero cell, in the order of
  // the categories, device before host.
  const std::vector<Bar> got = bars(dom);
  ASSERT_EQ(got.size(), 4u) << dom;
  const std::vector<std::string> estimate = {"weights/device",    "gradients/device",
                                             "optimizer_state/host", "activations/device",
                                             "comm_buffers/device", "other/device"};
  const std::vector<std::string> measured0 = {"weights/device",    "gradients/device",
                                              "optimizer_state/host", "activations/device",
                                              "other/device",      "unattributed/device"};
  const std::vector<std::string> measured1 = {"weights/device",      "gradients/device",
                                              "optimizer_state/host", "activations/device",
                                              "other/device",        "other/host",
                                              "unattributed/device"};
  const std::vector<std::pair<std::string, std::vector<std::string>>> want = {
      {"0/estimate", estimate}, {"0/measured", measured0},
      {"1/estimate", estimate}, {"1/measured", measured1}};
  for (size_t i = 0; i < want.size(); ++i) {
    EXPECT_EQ(got[i].rank + "/" + got[i].kind, want[i].first);
    EXPECT_EQ(got[i].segments, want[i].second) << "bar " << want[i].first;
  }

  // Peaks in MB (10^6 bytes) beside the bars.
  EXPECT_NE(dom.find("peak 153.5 MB"), std::string::npos) << "rank 0's measured peak";
  EXPECT_NE(dom.find("peak 161.8 MB"), std::string::npos) << "the estimated peak";

  // A line chart per rank with its four series (peak, live, activations and comm_buffers peaks),
  // and a table per rank with every category.
  EXPECT_EQ(occurrences(dom, "class=\"timeline\""), 2u);
  EXPECT_EQ(occurrences(dom, "class=\"series\""), 8u);
  EXPECT_EQ(occurrences(dom, "<table class=\"cmp\""), 2u);
  for (const char* name : kCategories)
    EXPECT_EQ(occurrences(dom, std::string("<tr data-category=\"") + name + "\""), 2u) << name;

  // The leak of rank 1, in words, in the warning box.
  EXPECT_NE(dom.find("id=\"leaks\""), std::string::npos);
  EXPECT_EQ(occurrences(dom, "class=\"leak\""), 1u);
  EXPECT_NE(dom.find("Rank 1: 'activations' grows by 4.19 MB per step (steps 2..7"),
            std::string::npos);
  // Its resident memory past the estimate, likewise.
  EXPECT_EQ(occurrences(dom, "class=\"resident\""), 1u);
  EXPECT_NE(dom.find("Rank 1: resident memory reached 812.0 MB by step 4, past the 520.0 MB expected by more than "
                     "the margin (650.0 MB allowed), since step 2; grown since step 1: 'activations'."),
            std::string::npos) << dom;

  // What a user sees: a full-size screenshot with something drawn on it (a blank page of this
  // size compresses to a few kB).
  const fs::path png = dir / "memory_report.png";
  ASSERT_TRUE(run_chromium(dir, dir / "memory_report.html",
                           "--screenshot=" + sh_quote(png.string()) + " --window-size=1400,1000",
                           dir / "screenshot.out"));
  const std::string image = slurp(png);
  EXPECT_EQ(png_size(image), std::make_pair(1400u, 1000u));
  EXPECT_GT(image.size(), 40'000u);
  // docs/images/memory_report.png is this screenshot: MEMRT_REPORT_SCREENSHOT=<path> keeps a copy.
  if (const char* keep = std::getenv("MEMRT_REPORT_SCREENSHOT"))
    fs::copy_file(png, keep, fs::copy_options::overwrite_existing);
}

// A sparse report — no category list, one non-zero cell, no step recorded, a term whose name
// would end the script if it were embedded raw — still draws, and says what is missing.
TEST(ReportHtmlInChromium, SparseReportStillRenders) {
  TempDir dir("sparse");
  const std::string json = R"({
  "version": 1, "world_size": 1,
  "ranks": [{
    "rank": 0,
    "estimate": {"categories": {"weights": {"device": 1000000}}, "peak_bytes": 1000000,
                 "terms": [{"source": "</script><!--<script>", "categories": {}}]},
    "measured": {"categories": {"weights": {"device": 0, "host": 2500000}, "gradients": {}},
                 "peak_bytes": 2500000},
    "timeline": [],
    "leaks": []
  }]
})";
  write(dir / "memory_report.html", memrt::render_memory_report_html(json));
  ASSERT_TRUE(run_chromium(dir, dir / "memory_report.html", "--dump-dom", dir / "dom.html"));
  const std::string dom = slurp(dir / "dom.html");
  ASSERT_EQ(rendered(dom), "ok") << dom;

  const std::vector<Bar> got = bars(dom);
  ASSERT_EQ(got.size(), 2u) << dom;
  EXPECT_EQ(got[0].segments, std::vector<std::string>{"weights/device"});
  EXPECT_EQ(got[1].segments, std::vector<std::string>{"weights/host"});
  EXPECT_NE(dom.find("No optimizer step was recorded."), std::string::npos);
  EXPECT_EQ(dom.find("id=\"leaks\""), std::string::npos) << "no leak, no warning";
  EXPECT_EQ(dom.find("id=\"resident\""), std::string::npos) << "no resident growth, no warning";
  EXPECT_NE(dom.find("&lt;/script&gt;&lt;!--&lt;script&gt;: no change"), std::string::npos)
      << "the term's name is shown as text";
}

// A report that is not JSON fails visibly instead of leaving an empty page.
TEST(ReportHtmlInChromium, BrokenJsonSaysSo) {
  TempDir dir("broken");
  write(dir / "memory_report.html", memrt::render_memory_report_html("{\"ranks\": ["));
  ASSERT_TRUE(run_chromium(dir, dir / "memory_report.html", "--dump-dom", dir / "dom.html"));
  const std::string dom = slurp(dir / "dom.html");
  EXPECT_EQ(rendered(dom).rfind("error: ", 0), 0u) << rendered(dom);
  EXPECT_NE(dom.find("The report could not be drawn"), std::string::npos);
}

}  // namespace
