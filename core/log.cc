#include "core/log.h"

#include <atomic>
#include <cstdio>

#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "absl/time/time.h"

namespace kvstep {
namespace {

std::atomic<int> g_level{static_cast<int>(LogLevel::kInfo)};

}  // namespace

void SetLogLevel(LogLevel level) {
  g_level.store(static_cast<int>(level), std::memory_order_relaxed);
}

LogLevel GetLogLevel() {
  return static_cast<LogLevel>(g_level.load(std::memory_order_relaxed));
}

bool ParseLogLevel(absl::string_view name, LogLevel* level) {
  static constexpr std::pair<absl::string_view, LogLevel> kNames[] = {
      {"error", LogLevel::kError},
      {"warning", LogLevel::kWarning},
      {"info", LogLevel::kInfo},
      {"debug", LogLevel::kDebug}};
  for (const auto& [n, l] : kNames) {
    if (n == name) {
      *level = l;
      return true;
    }
  }
  return false;
}

bool LogEnabled(LogLevel level) {
  return static_cast<int>(level) <= g_level.load(std::memory_order_relaxed);
}

void LogLine(LogLevel level, const std::string& message) {
  static constexpr char kLetters[] = {'E', 'W', 'I', 'D'};
  const std::string line = absl::StrCat(
      absl::FormatTime("%Y-%m-%dT%H:%M:%E6SZ ", absl::Now(),
                       absl::UTCTimeZone()),
      std::string(1, kLetters[static_cast<int>(level)]), " ", message, "\n");
  // One write per line, so that lines of concurrent threads do not mix.
  std::fwrite(line.data(), 1, line.size(), stderr);
}

}  // namespace kvstep
