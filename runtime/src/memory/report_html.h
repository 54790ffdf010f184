// The memory report as one self-contained HTML page (docs/memory.md, "Reports").
#pragma once

#include <string>

namespace memrt {

// `report_json` is the text of memory_report.json; the page embeds it and draws it with its own
// script: no network, no other file.
std::string render_memory_report_html(const std::string& report_json);

}  // namespace memrt
