# frozen_string_literal: true

require 'digest'
require_relative 'client'

module PuppetX
  module Vmhost
    # Commands and files in a guest through vmhostd (vm.exec, vm.file_push): what the
    # functions vmhost::guest_exec and vmhost::guest_file_push call. Only the request is shaped
    # here; every rule (allow_exec, limits, slots, audit) is the daemon's.
    module Guest
      # Seconds vmhostd may answer after a command's timeout_s (its own bound is 10), plus margin.
      EXEC_MARGIN = 40
      DEFAULT_EXEC_TIMEOUT_S = 60
      # vm.file_push's inline content limit.
      MAX_PUSH_INLINE = 768 * 1024

      # Standard base64 with padding, without the base64 gem (not a default gem in newer Rubies).
      def self.b64(data)
        [data.to_s].pack('m0')
      end

      # vm.exec params: NAME, ARGV (an array of strings, no shell) and OPTS (env as an array of
      # K=V or a hash, cwd, stdin, timeout_s, max_output, encoding).
      def self.exec_params(name, argv, opts = {})
        params = { 'name' => name, 'argv' => argv.map(&:to_s),
                   'timeout_s' => Integer(opts.fetch('timeout_s', DEFAULT_EXEC_TIMEOUT_S)) }
        env = opts['env']
        params['env'] = env.is_a?(Hash) ? env.map { |k, v| "#{k}=#{v}" } : env.map(&:to_s) unless env.nil?
        params['cwd'] = opts['cwd'] if opts.key?('cwd')
        params['stdin'] = b64(opts['stdin']) if opts.key?('stdin')
        params['max_output'] = Integer(opts['max_output']) if opts.key?('max_output')
        params['encoding'] = opts['encoding'] if opts.key?('encoding')
        params
      end

      # The shell's exit status of a vm.exec answer: the code, 128 + signal, 124 at the timeout.
      def self.exit_status(answer)
        return 124 if answer['timed_out']
        return 128 + answer['signal'] if answer['signal'].is_a?(Integer)

        answer['exit_code'].is_a?(Integer) ? answer['exit_code'] : 255
      end

      # Runs the command; the daemon's answer. With opts['check'], a command that did not exit
      # 0 raises Vmhost::Error naming its status and the start of its stderr.
      def self.exec(name, argv, opts = {}, client: nil)
        params = exec_params(name, argv, opts)
        client ||= Client.new(opts['socket'])
        answer = client.call('vm.exec', params, timeout: client.timeout + params['timeout_s'] + EXEC_MARGIN)
        status = exit_status(answer)
        if opts['check'] && !status.zero?
          raise Error, "#{name}: #{argv.first} exited with status #{status}: #{answer['stderr'].to_s[0, 500]}"
        end

        answer
      end

      # Permission bits: an Integer as it is, a String read as octal ('0644', '644').
      def self.mode(value)
        bits = value.is_a?(Integer) ? value : Integer(value.to_s.delete_prefix('0o'), 8)
        raise ArgumentError, "mode #{value.inspect} is above 07777" unless bits.between?(0, 0o7777)

        bits
      rescue ArgumentError, TypeError
        raise Error, "mode #{value.inspect}: not permission bits up to 07777 (write '0644')"
      end

      # vm.file_push params: the content inline with its sha256, OPTS mode, owner, mkdir.
      def self.push_params(name, path, content, opts = {})
        data = content.to_s.b
        if data.bytesize > MAX_PUSH_INLINE
          raise Error, "#{path}: #{data.bytesize} bytes, above the #{MAX_PUSH_INLINE} vm.file_push takes inline"
        end

        params = { 'name' => name, 'path' => path, 'content' => b64(data),
                   'sha256' => Digest::SHA256.hexdigest(data), 'mkdir' => opts.fetch('mkdir', false) }
        params['mode'] = mode(opts['mode']) if opts.key?('mode')
        params['owner'] = opts['owner'] if opts.key?('owner')
        params
      end

      # Writes the file; the daemon's answer {path, size, sha256}.
      def self.push(name, path, content, opts = {}, client: nil)
        params = push_params(name, path, content, opts)
        (client || Client.new(opts['socket'], timeout: Client::MUTATING_TIMEOUT)).call('vm.file_push', params)
      end
    end
  end
end
