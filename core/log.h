// Leveled logging to stderr: one line per event, with a UTC timestamp and
// the level, for a sidecar whose stderr the container runtime collects.
//
//   KVSTEP_LOG(kInfo, "session %x lapsed: %d blocks back", id, n);
//
// The arguments are formatted (absl::StrFormat) only when the level is on.
// The level is process-wide and may change at any time (SetLogLevel).
#ifndef KVSTEP_CORE_LOG_H_
#define KVSTEP_CORE_LOG_H_

#include <string>

#include "absl/strings/str_format.h"
#include "absl/strings/string_view.h"

namespace kvstep {

enum class LogLevel { kError = 0, kWarning = 1, kInfo = 2, kDebug = 3 };

// Messages at `level` and more severe are written. Default: kInfo.
void SetLogLevel(LogLevel level);
LogLevel GetLogLevel();
// "error", "warning", "info" or "debug".
bool ParseLogLevel(absl::string_view name, LogLevel* level);
bool LogEnabled(LogLevel level);
void LogLine(LogLevel level, const std::string& message);

}  // namespace kvstep

#define KVSTEP_LOG(level, ...)                             \
  do {                                                     \
    if (::kvstep::LogEnabled(::kvstep::LogLevel::level)) { \
      ::kvstep::LogLine(::kvstep::LogLevel::level,         \
                        ::absl::StrFormat(__VA_ARGS__));   \
    }                                                      \
  } while (false)

#endif  // KVSTEP_CORE_LOG_H_
