# frozen_string_literal: true

require 'json'
require_relative 'backup'

module PuppetX
  module Vmhost
    # The module's Bolt tasks (tasks/*.json and *.rb): each script reads its input (JSON on
    # stdin, Bolt's `input_method: stdin`) and calls Task.run with its name, which maps the task's
    # parameters onto the daemon's method, sends it (nothing under `_noop`) and prints the
    # answer as JSON; a failure is printed as Bolt's `_error` object and exits 1. Every rule is
    # vmhostd's: `options` (a hash) is sent as params as given.
    module Task
      # Task name => [method, the task parameters sent as the method's required params
      # (task name => param name), the optional ones sent when given].
      TASKS = {
        'snapshot' => ['vm.snapshot', { 'vm' => 'name', 'snapshot' => 'snapshot' }, %w[timeout_s requires]],
        'snapshots' => ['vm.snapshots', { 'vm' => 'name' }, []],
        'revert' => ['vm.revert', { 'vm' => 'name', 'snapshot' => 'snapshot' }, %w[timeout_s]],
        'snapshot_delete' => ['vm.snapshot_delete', { 'vm' => 'name', 'snapshot' => 'snapshot' }, %w[timeout_s]],
        'export' => ['vm.export', { 'vm' => 'name' }, %w[timeout_s requires]],
        'import' => ['vm.import', { 'backup' => 'backup' }, %w[name state]],
        'backups_prune' => ['vm.backups_prune', { 'vm' => 'name', 'keep' => 'keep' }, []]
      }.freeze

      # The method and params of task NAME for INPUT (the task's parameters; Bolt's own, such
      # as `_task` and `_installdir`, are not sent). Raises ArgumentError for a missing one.
      def self.request(name, input)
        method, required, optional = TASKS.fetch(name)
        base = {}
        required.each do |key, param|
          value = input[key]
          raise ArgumentError, "parameter #{key} is required" if value.nil? || value == ''

          base[param] = value
        end
        optional.each { |key| base[key] = input[key] unless input[key].nil? }
        options = input['options'] || {}
        raise ArgumentError, 'options must be a hash' unless options.is_a?(Hash)

        [method, Backup.params(base, options)]
      end

      # Runs task NAME with INPUT; prints the result (or Bolt's `_error`) on OUT and returns
      # the exit status.
      def self.run(name, input, out: $stdout, client: nil)
        method, params = request(name, input)
        if input['_noop']
          out.puts(JSON.generate(Backup.noop_answer(method, params)))
          return 0
        end
        client ||= Client.new(input['socket'], timeout: Client::MUTATING_TIMEOUT)
        result = client.call(method, params, timeout: Backup.wait(method, params))
        out.puts(JSON.generate({ 'result' => result }))
        0
      rescue DaemonError => e
        out.puts(JSON.generate(error(e.message, 'vmhost/daemon-error',
                                     { 'code' => e.code, 'kind' => e.kind, 'field' => e.field,
                                       'details' => e.details })))
        1
      rescue Error, ArgumentError, KeyError => e
        out.puts(JSON.generate(error(e.message, 'vmhost/task-error', {})))
        1
      end

      def self.error(msg, kind, details)
        { '_error' => { 'msg' => msg, 'kind' => kind, 'details' => details } }
      end

      # A task script's whole body: TEXT (what it read on stdin) parsed, then run.
      def self.main(name, text)
        input = text.to_s.strip.empty? ? {} : JSON.parse(text)
        exit(run(name, input))
      rescue JSON::ParserError => e
        $stdout.puts(JSON.generate(error("the task's input is not JSON: #{e.message}", 'vmhost/task-error', {})))
        exit(1)
      end
    end
  end
end
