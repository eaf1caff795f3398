// The programs' command lines (train_gpt, generate, precision_study, plot_loss): CLI11 parses them (option
// names, one value each, each option once, needs, excludes, required, --help), and mixtape's readers read
// each value (integer_argument, number_argument: the whole text, in range). Every error is a mixtape::Error
// in the program's own words, naming the option, so run_program reports it as "error: ..." with exit
// status 1.
//
// The programs' words: a value a reader refuses throws from the option's callback, which CLI11 passes
// through parse() unchanged (it catches only its own errors). A rule CLI11 enforces (needs, excludes,
// required) carries the program's message, reported in place of CLI11's text; unknown and repeated options
// and options without their value are found after the parse (allow_extras keeps the unknown ones), before
// any other error, as a typo explains the rest. --help wins over every error: the help is printed and the
// program ends with status 0.
#pragma once

#include <CLI/CLI.hpp>

#include <algorithm>
#include <climits>
#include <cstdint>
#include <functional>
#include <iostream>
#include <limits>
#include <map>
#include <memory>
#include <sstream>
#include <set>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include "tensor/error.h"
#include "train/training.h"

namespace mixtape::cli {

// CLI11's help without the "Needs:" and "Excludes:" lists it appends to an option's name and type (they
// break the columns, and one option excluding twenty makes a line of hundreds of characters): the options'
// help texts say their rules in words.
class HelpFormatter : public CLI::Formatter {
 public:
  std::string make_option_opts(const CLI::Option* option) const override {
    std::ostringstream out;
    if (!option->get_option_text().empty()) return " " + option->get_option_text();
    if (option->get_type_size() != 0) {
      if (!option->get_type_name().empty()) out << " " << get_label(option->get_type_name());
      if (!option->get_default_str().empty()) out << "=" << option->get_default_str();
      if (option->get_expected_max() == CLI::detail::expected_max_vector_size) out << " ...";
      else if (option->get_expected_min() > 1) out << " x " << option->get_expected();
      if (option->get_required()) out << " " << get_label("REQUIRED");
    }
    if (!option->get_envname().empty()) out << " (" << get_label("Env") << ":" << option->get_envname() << ")";
    return out.str();
  }
};

class CommandLine {
 public:
  CommandLine(std::string program, const std::string& description)
      : app(description, program), program_(std::move(program)) {
    app.allow_extras();  // unknown options are reported by check_names, in the program's words
    auto formatter = std::make_shared<HelpFormatter>();
    formatter->column_width(34);
    app.formatter(formatter);
  }

  // The options' callbacks hold this object: it stays where it is made.
  CommandLine(const CommandLine&) = delete;
  CommandLine& operator=(const CommandLine&) = delete;

  CLI::App app;

  // "<program>: unknown option '<arg>'" unless set; the help is printed (stdout) before it when
  // help_on_unknown.
  std::function<std::string(const std::string& arg)> unknown_message;
  bool help_on_unknown = true;
  // "<program>: <name> is given twice (give each option once)" unless set; `written` is the name as the
  // second use spelled it (an option may have several names).
  std::function<std::string(const CLI::Option& option, const std::string& written)> repeated_message;

  // An option of one value, read by `read` (which throws mixtape::Error naming the option when it refuses it).
  CLI::Option* add(const std::string& name, std::function<void(const std::string&)> read, const std::string& type,
                   const std::string& help) {
    return app.add_option_function<std::string>(name, std::move(read), help)->type_name(type);
  }
  // A value that must not be empty (an empty one would read as "not given"); `what` names the value in the
  // error "<program>: <name> needs <what>, got ''".
  CLI::Option* text(const std::string& name, std::string& target, const std::string& type, const std::string& help,
                    const std::string& what = "a value") {
    const std::string first = name.substr(0, name.find(','));  // "--model" of "--model,--init"
    return add(name, [this, first, &target, what](const std::string& value) {
      target = nonempty(written_name(first, value), value, what);
    }, type, help);
  }
  const std::string& nonempty(const std::string& name, const std::string& value,
                              const std::string& what = "a value") const {
    check(!value.empty(), program_, ": ", name, " needs ", what, ", got ''");
    return value;
  }
  // An integer in [low, high], as integer_argument reads it; high is at most what Int holds.
  template <class Int>
  CLI::Option* integer(const std::string& name, Int& target, int64_t low, const std::string& help,
                       int64_t high = largest<Int>()) {
    return add(name, [this, name, &target, low, high](const std::string& value) {
      target = static_cast<Int>(integer_argument(program_, name, value, low, high));
    }, "N", help);
  }
  // A finite decimal number >= 0, as number_argument reads it.
  CLI::Option* number(const std::string& name, double& target, const std::string& help) {
    return add(name, [this, name, &target](const std::string& value) {
      target = number_argument(program_, name, value);
    }, "X", help);
  }
  // A finite decimal number > 0: "<program>: <name> must be > 0, got '<value>'" for 0.
  CLI::Option* positive_number(const std::string& name, double& target, const std::string& help) {
    return add(name, [this, name, &target](const std::string& value) {
      target = number_argument(program_, name, value);
      check(target > 0, program_, ": ", name, " must be > 0, got '", value, "'");
    }, "X", help);
  }
  // A device, as Device::parse reads it ("cpu", "cuda", "cuda:N").
  CLI::Option* device(const std::string& name, Device& target, const std::string& help) {
    return add(name, [this, name, &target](const std::string& value) {
      target = Device::parse(nonempty(name, value));
    }, "cpu|cuda|cuda:N", help);
  }
  // A switch that sets `target` to `value` (no "=value" form).
  CLI::Option* flag(const std::string& name, bool& target, bool value, const std::string& help) {
    return app.add_flag_callback(name, [&target, value] { target = value; }, help)->disable_flag_override();
  }

  // CLI11's relations between options, with the program's message for the run that breaks them.
  void needs(CLI::Option* option, CLI::Option* other, std::string message) {
    option->needs(other);
    rules_.push_back({Rule::Needs, option, other, std::move(message)});
  }
  void excludes(CLI::Option* option, CLI::Option* other, std::string message) {
    option->excludes(other);
    rules_.push_back({Rule::Excludes, option, other, std::move(message)});
  }
  void required(CLI::Option* option, std::string message) {
    option->required();
    rules_.push_back({Rule::Required, option, nullptr, std::move(message)});
  }

  // Parses the command line: false when it asked for --help (printed on stdout; the program ends with
  // status 0), else true with every option read, or a mixtape::Error.
  bool parse(int argc, char** argv) {
    args_.assign(argv + 1, argv + argc);
    // What follows "--" is positional arguments only, whatever it looks like.
    options_end_ = std::find(args_.begin(), args_.end(), "--") - args_.begin();
    try {
      app.parse(argc, argv);
    } catch (const CLI::CallForHelp&) {
      return print_help();
    } catch (const CLI::ParseError& error) {
      if (help_requested()) return print_help();
      check_names();
      check_last_value();
      if (is_rule_error(error)) check_rules();
      fail(program_, ": ", error.what());
    } catch (const Error&) {
      if (help_requested()) return print_help();
      check_names();
      throw;
    }
    check_names();
    return true;
  }

  // Whether the command line gives the option.
  bool given(const std::string& name) const { return app.count(name) > 0; }

  // The names ("--lr") of the options on the command line.
  std::set<std::string> given_names() const {
    std::set<std::string> names;
    for (const CLI::Option* option : app.get_options())
      if (option->count() > 0)
        for (const std::string& name : option->get_lnames()) names.insert("--" + name);
    return names;
  }

  const std::string& program() const { return program_; }

 private:
  template <class Int>
  static constexpr int64_t largest() {
    return static_cast<int64_t>(std::min<uint64_t>(std::numeric_limits<Int>::max(), INT64_MAX));
  }

  bool print_help() const {
    std::cout << app.help();
    return false;
  }
  // Whether the command line gives --help (as an option: CLI11 counts it before it runs the options'
  // callbacks, so a value they refuse does not hide it).
  bool help_requested() const {
    const CLI::Option* help = app.get_help_ptr();
    return help != nullptr && help->count() > 0;
  }
  static bool is_rule_error(const CLI::ParseError& error) {
    return dynamic_cast<const CLI::RequiresError*>(&error) || dynamic_cast<const CLI::ExcludesError*>(&error) ||
           dynamic_cast<const CLI::RequiredError*>(&error);
  }

  struct Rule {
    enum Kind { Needs, Excludes, Required } kind;
    CLI::Option* option;
    CLI::Option* other;
    std::string message;
  };

  // The name the option `name` is written with before `value` ("--init" of "--init FILE" for
  // "--model,--init"), or `name`.
  std::string written_name(const std::string& name, const std::string& value) const {
    const CLI::Option* option = app.get_option_no_throw(name);
    for (size_t i = 0; i + 1 < args_.size(); ++i)
      if (args_[i + 1] == value && args_[i].starts_with("--") && option->check_name(args_[i])) return args_[i];
    return name;
  }

  // Unknown options and options written "--name=" without the value (the first of either), then repeated
  // ones (the first second use), in the program's words, all before "--". A switch with a value
  // ("--eval-only=false") is no option either.
  void check_names() const {
    const std::vector<std::string> extras = app.remaining();
    for (size_t i = 0; i < options_end_; ++i) {
      const std::string& arg = args_[i];
      const size_t equals = arg.find('=');
      const CLI::Option* option = arg.starts_with("--") ? app.get_option_no_throw(arg.substr(0, equals)) : nullptr;
      // CLI11 reads "--name=" as "--name" and takes the next argument as its value.
      check(!(option && option->get_expected_max() > 0 && equals == arg.size() - 1), program_, ": ",
            arg.substr(0, equals), " needs a value");
      const bool switch_with_value = option && option->get_expected_max() == 0 && equals != arg.npos;
      if (!switch_with_value && std::find(extras.begin(), extras.end(), arg) == extras.end()) continue;
      if (help_on_unknown) std::cout << app.help();
      fail(unknown_message ? unknown_message(arg) : program_ + ": unknown option '" + arg + "'");
    }
    std::map<const CLI::Option*, int> uses;
    for (size_t i = 0; i < options_end_; ++i) {
      const std::string name = args_[i].substr(0, args_[i].find('='));
      const CLI::Option* option = name.starts_with("--") ? app.get_option_no_throw(name) : nullptr;
      // count() > 1: a value that merely looks like a name ("--data --lr") is no use of that option.
      if (option == nullptr || option->count() < 2 || ++uses[option] < 2) continue;
      fail(repeated_message ? repeated_message(*option, name)
                            : program_ + ": " + name + " is given twice (give each option once)");
    }
  }

  void check_rules() const {
    for (const Rule& rule : rules_) {
      const bool broken = rule.kind == Rule::Required ? rule.option->count() == 0
                          : rule.kind == Rule::Needs  ? rule.option->count() > 0 && rule.other->count() == 0
                                                      : rule.option->count() > 0 && rule.other->count() > 0;
      check(!broken, rule.message);
    }
  }

  // An option at the end of the line, without its value (CLI11 takes the next argument as the value
  // whatever it looks like, so only the last one can lack it).
  void check_last_value() const {
    if (args_.empty() || options_end_ < args_.size()) return;
    const CLI::Option* option = app.get_option_no_throw(args_.back());
    check(option == nullptr || option->get_items_expected_min() == 0 || !args_.back().starts_with("--"),
          program_, ": ", args_.back(), " needs a value");
  }

  std::string program_;
  std::vector<std::string> args_;
  size_t options_end_ = 0;  // the index of "--" in args_, or its size
  std::vector<Rule> rules_;
};

}  // namespace mixtape::cli
